"""One configuration mechanism: strict models, dotted errors, derived flags, stable hashes.

Every option set (model, training sections, prepare, probe, job specs) is a
:class:`elmo_service.settings_base.StrictModel`. These tests hold the contract
the rest of the suite relies on: unknown keys are refused with the full dotted
name and a did-you-mean hint at every entry point (YAML, ``--set``, a job's
spec), a flag's default is its model's default, and the hash that identifies a
run (and a preparation) is what it was before the models were pydantic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elmo_jobs.spec import JobIn, PrepareIn, resolve_train_config
from elmo_pretrain.cli import build_parser, main
from elmo_pretrain.config import TrainConfig, config_hash, load_config
from elmo_pretrain.prepare import CLI_FIELDS, JOB_FIELDS, PrepareOptions, _params_hash
from elmo_pretrain.probe.options import (
    CLI_CONFIG_FIELDS,
    PER_KIND,
    TASK_DEFAULTS,
    ProbeConfig,
    ProbeOptions,
    probe_config,
)
from elmo_service.bilm.config import BiLMConfig
from elmo_service.errors import ConfigError, InputError
from elmo_service.settings_base import to_argv

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

# the first models/ptb's training config (configs/ptb-sentences.yaml) as its run recorded it (before data.mode, data.rows,
# optim.loss_reduction, model.dropout_tokens... existed); hash computed on main before
# the configs became pydantic models
PTB_RUN_CONFIG = {
    "model": {"char_dim": 15, "filters": [[1, 25], [2, 50], [3, 75], [4, 100], [5, 125], [6, 150]],
              "n_highway": 1, "activation": "tanh", "max_chars_per_token": 24, "projection_dim": 300,
              "lstm_dim": 300, "n_layers": 2, "cell_clip": None, "proj_clip": None, "residual": False,
              "dropout": 0.35, "max_sentence_tokens": 512},
    "data": {"path": "corpus", "tokens_per_batch": 1280, "max_tokens": 96, "pad_multiple": 16,
             "bucket_pool": 64},
    "softmax": {"kind": "adaptive", "n_samples": 8192, "cutoffs": [2000, 6000], "div_value": 2.0},
    "optim": {"name": "adam", "lr": 0.002, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0,
              "adagrad_init_acc": 1.0, "clip_norm": 5.0, "warmup_steps": 200, "decay": "cosine",
              "min_lr_ratio": 0.02},
    "train": {"steps": 10000, "max_minutes": 0.0, "seed": 1234, "directions": "forward",
              "device": "auto", "precision": "auto", "compile": False, "threads": 2, "log_every": 50,
              "eval_every": 1000, "eval_max_sentences": 0, "progress": True},
    "checkpoint": {"every_steps": 0, "every_minutes": 15.0, "keep": 3},
}  # fmt: skip
PTB_HASH = "f6abcdceb94bf910"
STREAM_PTB_HASH = "047685c7213d3b90"  # the run folder of configs/ptb.yaml recorded it
DEFAULTS_HASH = "fd6f03ca7a2ff614"  # TrainConfig() on main


# ------------------------------------------------------------------ hashes: runs resume


def test_an_old_run_config_hashes_as_before_and_round_trips():
    cfg = TrainConfig.from_dict(PTB_RUN_CONFIG)
    assert config_hash(cfg) == PTB_HASH
    assert config_hash(TrainConfig.from_dict(cfg.to_dict())) == PTB_HASH  # the saved form
    assert config_hash(TrainConfig()) == DEFAULTS_HASH
    # the config file behind that run still says the same
    assert config_hash(load_config(ROOT / "configs" / "ptb-sentences.yaml")) == PTB_HASH
    # the bundled stream run's recorded config hashes as configs/ptb.yaml does today, so it resumes
    saved = json.loads((ROOT / "models" / "ptb" / "run.json").read_text())["config"]
    assert config_hash(TrainConfig.from_dict(saved)) == STREAM_PTB_HASH
    assert config_hash(load_config(ROOT / "configs" / "ptb.yaml")) == STREAM_PTB_HASH
    # tuples in the model, lists in the saved form
    assert cfg.model.filters[0] == (1, 25) and cfg.to_dict()["model"]["filters"][0] == [1, 25]
    # a change that matters changes the hash; run length does not
    assert config_hash(cfg.model_copy(update={"optim": cfg.optim.replace(lr=0.1)})) != PTB_HASH
    assert config_hash(cfg.model_copy(update={"train": cfg.train.replace(steps=5)})) == PTB_HASH


def test_the_bundled_models_config_loads_unchanged():
    raw = json.loads((ROOT / "models" / "default" / "config.json").read_text())
    cfg = BiLMConfig.from_dict(raw["model"])
    added_later = {"dropout_tokens": True, "lstm_projection": True}  # at their defaults
    assert cfg.to_dict() == {**raw["model"], **added_later}
    prov = TrainConfig.from_dict(raw["provenance"]["training_config"])
    assert config_hash(prov) == "a510e91b97b3cc29"  # on main


def test_a_preparations_params_hash_is_as_before():
    assert _params_hash(PrepareOptions(), [], []) == "3de395cd2d1b8d73"  # on main
    opts = PrepareOptions(
        tokenizer="word",
        vocab_size=200,
        byte_fallback=False,
        heldout_fraction=0.05,
        heldout_files=["a.txt"],
        threads=1,
    )
    assert _params_hash(opts, [{"path": "x", "bytes": 1, "mtime": 2}], []) == "7336ef6e87206023"


# ------------------------------------------------------------------ unknown keys, dotted names


def test_unknown_keys_name_the_dotted_field_with_a_hint_in_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("\noptim:\n", "\noptim:\n  lrr: 0.1\n", 1))
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert e.value.field == "optim.lrr"
    assert "unknown config key 'optim.lrr' (did you mean 'lr'?)" in e.value.message
    bad.write_text("trainer:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"'trainer' \(did you mean 'train'\?\)") as e:
        load_config(bad)
    assert e.value.field == "trainer"


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    """Plain YAML keeps the last of two equal keys: a second section would silently
    replace the first."""
    bad = tmp_path / "twice.yaml"
    bad.write_text(TINY.read_text() + "\noptim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"key 'optim' appears twice \(again on line \d+\)") as e:
        load_config(bad)
    assert e.value.field == "optim"
    bad.write_text("optim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="'lr' appears twice") as e:
        load_config(bad)
    assert e.value.field == "lr"


def test_unknown_keys_in_set_overrides(tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["model.lstm_dimz=8"])
    assert e.value.field == "model.lstm_dimz" and "did you mean 'lstm_dim'" in e.value.message
    rc = main(["train", str(TINY), "--run-dir", str(tmp_path / "r"), "--set", "data.tokens=5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "unknown config key 'data.tokens'" in err and "did you mean" in err


def test_unknown_keys_in_a_job_spec():
    job = JobIn(corpus="c.txt", config={"softmax": {"n_sample": 5}})
    with pytest.raises(ConfigError) as e:
        resolve_train_config(job)
    assert e.value.field == "config.softmax.n_sample"
    assert "did you mean 'n_samples'" in e.value.message
    # the network's own checks are prefixed too (no renaming workaround)
    with pytest.raises(ConfigError) as e:
        resolve_train_config(JobIn(corpus="c.txt", config={"model": {"n_layers": 0}}))
    assert e.value.field == "config.model.n_layers" and "must be >= 1" in e.value.message
    # the job's prepare section is the CLI's PrepareOptions, strict and closed
    with pytest.raises(ConfigError) as e:
        JobIn(corpus="c.txt", prepare={"vocab_sise": 300})
    assert e.value.field == "prepare.vocab_sise" and "did you mean 'vocab_size'" in e.value.message
    # JSON bodies may carry Infinity / NaN (Python's json reads them): refused, named
    with pytest.raises(ConfigError) as e:
        resolve_train_config(JobIn(corpus="c.txt", config={"optim": {"lr": float("inf")}}))
    assert e.value.field == "config.optim.lr" and "finite" in e.value.message


def test_type_and_range_errors_name_the_field():
    cases = [
        (["train.steps=many"], "train.steps", "expected int, got 'many'"),
        (["optim.lr=true"], "optim.lr", "expected float, got True"),
        (["optim.lr=0"], "optim.lr", "must be positive"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio", "must be in [0, 1]"),
        (["model.dropout=1.0"], "model.dropout", "must be in [0, 1)"),
        (["softmax.kind=hierarchical"], "softmax.kind", "'sampled'"),
        (["softmax.cutoffs=[9, 3]"], "softmax.cutoffs", "must increase"),
        (["optim.betas=[0.9]"], "optim.betas", "too few items"),
        (["model.filters=[[60, 4]]"], "model.filters", "bad filter [60, 4]"),
        (["data.tokens_per_batch=8"], "data.tokens_per_batch", "must be >= data.max_tokens"),
        (["model=3"], "model", "expected a mapping"),
        # YAML's .inf / .nan would pass a range check and only fail as a NaN loss later
        (["optim.lr=.inf"], "optim.lr", "finite"),
        (["optim.weight_decay=.nan"], "optim.weight_decay", "finite"),
        (["optim.highway_gate_bias=-.inf"], "optim.highway_gate_bias", "finite"),
        (["model.cell_clip=.inf"], "model.cell_clip", "finite"),
    ]
    for sets, field, words in cases:
        with pytest.raises(ConfigError) as e:
            load_config(TINY, sets)
        assert e.value.field == field, (sets, e.value.field)
        assert e.value.message.startswith(f"{field}: ") and words in e.value.message, e.value
    # an int is a float; YAML lists are tuples
    cfg = load_config(TINY, ["optim.lr=1", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.9)


def test_model_config_errors_name_the_bare_field_and_it_is_immutable():
    with pytest.raises(ConfigError) as e:
        BiLMConfig(lstm_dim=0)
    assert e.value.field == "lstm_dim" and e.value.message == "lstm_dim: must be positive"
    with pytest.raises(ConfigError, match="did you mean 'n_highway'"):
        BiLMConfig.from_dict({"n_higway": 1})
    cfg = BiLMConfig()
    with pytest.raises(ConfigError):
        cfg.lstm_dim = 8  # shared by a model and its artifact: copy with replace()
    assert cfg.replace(lstm_dim=8).lstm_dim == 8 and cfg.lstm_dim == 1024
    with pytest.raises(ConfigError, match="n_layers"):
        cfg.replace(n_layers=0)
    # a training section checks assignment as well
    t = TrainConfig()
    with pytest.raises(ConfigError) as e:
        t.train.steps = 0
    assert e.value.field == "steps"


def test_prepare_options_raise_input_errors_naming_the_field():
    with pytest.raises(InputError) as e:
        PrepareOptions(vocab_size=2)
    assert e.value.field == "vocab_size" and "must be in [4, 2000000]" in e.value.message
    with pytest.raises(InputError, match="did you mean 'dedupe'"):
        PrepareOptions(dedup=False)


# ------------------------------------------------------------------ flags derived from the models


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def test_prepare_flags_default_to_the_models_defaults():
    args = _subparser("prepare").parse_args(["in.txt", "--out", "o"])
    defaults = PrepareOptions()
    for name in CLI_FIELDS:
        assert getattr(args, name) == getattr(defaults, name), name
    args = _subparser("prepare").parse_args(
        ["in.txt", "--out", "o", "--no-dedupe", "--heldout", "a", "b", "--vocab-size", "300"]
    )
    assert (args.dedupe, args.heldout_files, args.vocab_size) == (False, ["a", "b"], 300)
    # help text is the field's description
    helps = {a.dest: a.help for a in _subparser("prepare")._actions}
    assert PrepareOptions.model_fields["vocab_size"].description in helps["vocab_size"]


def test_a_jobs_prepare_section_becomes_the_same_options_on_the_command_line():
    job = PrepareIn(vocab_size=300, byte_fallback=False, lowercase=True, heldout_fraction=0.05)
    args = _subparser("prepare").parse_args(["in.txt", "--out", "o", *job.cli_args()])
    for name in JOB_FIELDS:
        assert getattr(args, name) == getattr(job, name), name
        # one declaration: the job's field is the CLI option's (default, bounds, description)
        a, b = PrepareIn.model_fields[name], PrepareOptions.model_fields[name]
        assert (a.default, a.description, a.metadata) == (b.default, b.description, b.metadata)
    assert to_argv(PrepareIn()) == to_argv(PrepareIn(), JOB_FIELDS)


def test_probe_flags_default_to_the_models_defaults():
    args = _subparser("probe").parse_args(["tagging"])
    opts = ProbeOptions(task="tagging")
    for name in ProbeOptions.model_fields:
        assert getattr(args, name) == getattr(opts, name), name
    for name in CLI_CONFIG_FIELDS:
        want = None if name in PER_KIND else getattr(ProbeConfig(), name)
        assert getattr(args, name) == want, name
    # per task kind when not given, the flag when given
    given = {k: getattr(args, k) for k in CLI_CONFIG_FIELDS}
    assert probe_config("sentences", **given) == TASK_DEFAULTS["sentences"]
    assert probe_config("tokens", **{**given, "epochs": 2}).epochs == 2
    with pytest.raises(ConfigError, match="epochs: must be >= 1"):
        probe_config("tokens", epochs=0)


def test_probe_service_names_a_service_it_cannot_use():
    """`elmo-pretrain probe --service` (through elmo_client): one line naming it."""
    from elmo_pretrain.probe.service import check_service

    with pytest.raises(InputError) as e:
        check_service("http://127.0.0.1:9", None)
    assert e.value.field == "service"
    assert e.value.message.startswith("http://127.0.0.1:9 is not reachable"), e.value.message
    with pytest.raises(InputError) as e:
        check_service("127.0.0.1:8000", None)  # no scheme
    assert e.value.field == "service" and "not an http(s) URL" in e.value.message


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)  # strict: an unknown or misspelt key fails here
    assert cfg.train.steps >= 1
