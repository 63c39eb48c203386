"""Training: config errors, end to end, exact resume, checkpoints, signals, softmaxes, exact eval."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.cli import main
from elmo_pretrain.config import TrainConfig, apply_overrides, config_hash, load_config
from elmo_pretrain.data import BucketBatcher, Corpus
from elmo_pretrain.evaluate import evaluate, load_run
from elmo_pretrain.export import export
from elmo_pretrain.optim import lr_at
from elmo_pretrain.softmax import LinearSoftmax
from elmo_pretrain.train import build_model, run_training
from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.errors import ConfigError
from tests.support.corpora import prepared_corpus, quiet

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("corpus"), 800, 200, seed=3)


def tiny(corpus_dir, *sets: str) -> TrainConfig:
    raw = yaml.safe_load(TINY.read_text())
    sets = (f"data.path={corpus_dir}", "train.progress=false", "train.threads=1", *sets)
    return TrainConfig.from_dict(apply_overrides(raw, list(sets)))


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def stops(run_dir: Path) -> list[tuple[str, int]]:
    """(reason, step) of each stop record: one per training segment, why it ended."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["reason"], r["step"]) for r in recs if r.get("event") == "stop"]


# ------------------------------------------------------------------ config


def test_unknown_key_fails_before_any_work(corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", str(TINY), "--run-dir", str(run), "--set", "optim.lrr=0.1"])
    assert rc == 2 and "unknown config key 'optim.lrr'" in capsys.readouterr().err
    assert not run.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("  n_highway: 1", "  n_highway: 1\n  n_higway: 2"))
    with pytest.raises(ConfigError, match="model.n_higway"):
        load_config(bad)
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        load_config(TINY, ["train.steps=many"])
    with pytest.raises(ConfigError, match="softmax.kind"):
        load_config(TINY, ["softmax.kind=hierarchical"])
    cfg = load_config(TINY, ["optim.lr=0.2", "model.filters=[[1, 4], [2, 4]]"])
    assert cfg.optim.lr == 0.2 and cfg.model.filters == ((1, 4), (2, 4))
    # run length and cadence do not change the run's identity
    assert config_hash(cfg) == config_hash(
        load_config(TINY, ["optim.lr=0.2", "model.filters=[[1, 4], [2, 4]]", "train.steps=99"])
    )


def test_lr_schedule_warmup_and_decay():
    cfg = load_config(
        TINY, ["optim.warmup_steps=10", "optim.decay=linear", "optim.min_lr_ratio=0.0"]
    )
    o = cfg.optim
    assert lr_at(0, o, 110) == pytest.approx(o.lr / 10)
    assert lr_at(9, o, 110) == pytest.approx(o.lr)
    assert lr_at(60, o, 110) == pytest.approx(o.lr / 2)
    assert lr_at(110, o, 110) == pytest.approx(0.0)


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_prepare_train_export_embed(corpus_dir, tmp_path):
    from elmo_service.embedder import Embedder

    run = tmp_path / "run"
    res = run_training(tiny(corpus_dir, "train.steps=30"), run, log=quiet)
    assert res["step"] == 30 and res["heldout"]["avg_ppl"] < 200  # the vocabulary is 200
    out = export(run, tmp_path / "model")
    assert out["step"] == 30
    emb = Embedder.load(tmp_path / "model", threads=1)
    got = emb.embed(["The old dog sees a cat.", "Anna watches the ships near the river!"])
    assert got[0].layers.shape[0] == 3 and got[0].layers.shape[2] == 32
    assert np.isfinite(got[1].layers).all()
    prov = emb.artifact.provenance
    assert prov["step"] == 30 and prov["tokens_seen"] == res["tokens_seen"]
    assert prov["heldout"]["avg_ppl"] == pytest.approx(res["heldout"]["avg_ppl"])
    assert prov["corpus"]["summary"]["train_sentences"] > 0
    names = set(emb.model.state_dict())
    assert not any("softmax" in n for n in names)
    # committed provenance carries no machine-specific path prefixes
    blob = json.dumps(prov)
    assert str(tmp_path) not in blob and str(Path.cwd()) not in blob
    # the export stores its self-test, and this model reproduces it (GET /v1/selftest's check)
    from elmo_service.selftest import compare, load_selftest

    st = load_selftest(tmp_path / "model")
    assert st is not None and st.meta["model_version"] == out["version"]
    assert compare(st.vectors, emb.run_batch(st.tokens))["within_bound"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sampled", "full"])
def test_exported_lm_re_evaluates_without_the_run(corpus_dir, tmp_path, capsys, kind):
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=10", f"softmax.kind={kind}"), run, log=quiet)
    test_file = tmp_path / "test.txt"
    test_file.write_text("The old dog sees a cat.\nAnna watches the ships near the river!\n")
    want = evaluate(run, file=str(test_file))
    lm = tmp_path / "lm"
    assert main(["export", str(run), str(lm), "--lm"]) == 0
    assert (lm / "lm.safetensors").is_file() and not (lm / "corpus" / "shards").exists()
    # the run and its prepared corpus are gone: the exported LM alone must do
    import shutil

    shutil.rmtree(run)
    capsys.readouterr()
    assert main(["eval", str(lm), "--file", str(test_file), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step"] == 10 and got["predictions"] == want["predictions"]
    assert got["forward_ppl"] == pytest.approx(want["forward_ppl"], rel=1e-6)
    assert got["avg_ppl"] == pytest.approx(want["avg_ppl"], rel=1e-6)


@pytest.mark.slow
def test_run_dir_with_another_run_is_refused(corpus_dir, tmp_path):
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=2", "checkpoint.every_steps=0"), run, log=quiet)
    with pytest.raises(ConfigError, match="different run.*optim.lr"):
        run_training(tiny(corpus_dir, "train.steps=2", "optim.lr=0.5"), run, log=quiet)
    with pytest.raises(ConfigError, match="already holds this run"):
        run_training(tiny(corpus_dir, "train.steps=2"), run, log=quiet)
    res = run_training(
        tiny(corpus_dir, "train.steps=2", "optim.lr=0.5"), run, force=True, log=quiet
    )
    assert res["step"] == 2


# ------------------------------------------------------------------ resume


@pytest.mark.slow
def test_resume_is_exact(corpus_dir, tmp_path):
    """N steps, stop, resume N more == 2N in one go: losses and weights bit-identical (fp32 eager)."""
    sets = (
        "train.steps=16",
        "train.log_every=1",
        "checkpoint.every_steps=0",
        "optim.warmup_steps=4",
    )
    one = tmp_path / "one"
    run_training(tiny(corpus_dir, *sets), one, log=quiet)
    two = tmp_path / "two"
    first = run_training(tiny(corpus_dir, *sets), two, stop_after=8, log=quiet)
    assert first["step"] == 8 and first["stopped"].startswith("stop after")
    assert stops(two) == [("stop_after", 8)]
    run_training(tiny(corpus_dir, *sets), two, resume=True, log=quiet)
    assert stops(two) == [("stop_after", 8), ("finished", 16)]
    assert losses(one) == losses(two) and len(losses(one)) == 16
    a, b = ckpt.load_latest(one)[1], ckpt.load_latest(two)[1]
    assert a["step"] == b["step"] == 16 and a["data"] == b["data"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_readme_resume_line_resumes_the_launched_run(corpus_dir, tmp_path, capsys):
    """`train FILE --run-dir R --set ...` then `train FILE --run-dir R --resume` (no --set) resumes
    that run; a resumable change is kept for later resumes; a real conflict names the field."""
    run = tmp_path / "run"
    sets = ["--set", f"data.path={corpus_dir}", "--set", "model.lstm_dim=24"]
    sets += ["--set", "train.progress=false", "--set", "train.steps=4"]
    assert main(["train", str(TINY), "--run-dir", str(run), *sets, "--stop-after", "2"]) == 0
    assert ckpt.load_latest(run)[1]["step"] == 2
    capsys.readouterr()
    # the README's line: the YAML says data.path=data/tiny and lstm_dim 32; the run's values win
    assert main(["train", str(TINY), "--run-dir", str(run), "--resume"]) == 0, capsys.readouterr()
    st = ckpt.load_latest(run)[1]
    saved = json.loads((run / "run.json").read_text())["config"]
    assert saved["data"]["path"] == str(corpus_dir) and saved["model"]["lstm_dim"] == 24
    assert st["step"] == 4 and st["config_hash"] == config_hash(TrainConfig.from_dict(saved))
    # run length may change on resume, and the change sticks for the next plain resume
    args = ["train", str(TINY), "--run-dir", str(run), "--resume"]
    assert main([*args, "--set", "train.steps=6"]) == 0
    assert main(args) == 0 and ckpt.load_latest(run)[1]["step"] == 6
    capsys.readouterr()
    # a real conflict: an explicit --set, or a file that changed a field of the run
    assert main([*args, "--set", "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optim.lr: the run has 0.01, --set gives 0.5" in err and len(err.splitlines()) == 1
    edited = tmp_path / "edited.yaml"
    edited.write_text(TINY.read_text().replace("n_highway: 1", "n_highway: 2"))
    assert main(["train", str(edited), "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"model.n_highway: the run has 1, {edited} gives 2" in err and "lstm_dim" not in err
    # a run from before launch records: the file's disagreeing fields keep the run's values
    (run / "launch.json").unlink()
    assert main([*args, "--set", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "keeping the run's saved" in out and "data.path" in out and "model.lstm_dim" in out
    assert ckpt.load_latest(run)[1]["step"] == 7


# ------------------------------------------------------------------ checkpoints


def test_checkpoints_are_atomic_pruned_and_skip_corrupt_ones(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(
            tmp_path, step, {"step": step, "w": torch.full((4,), float(step))}, keep=2
        )
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000002.pt",
        "step-00000003.pt",
    ]

    def crash(obj, f):  # dies half-way through writing
        f.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write checkpoint .*step-00000004\.pt"):
        ckpt.save_checkpoint(tmp_path, 4, {"step": 4})
    monkeypatch.undo()
    d = ckpt.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == [
        "step-00000002.pt",
        "step-00000002.pt.sha256",
        "step-00000003.pt",
        "step-00000003.pt.sha256",
    ]
    assert ckpt.load_latest(tmp_path, log=quiet)[1]["step"] == 3
    # a torn newest file (e.g. copied mid-write by hand) is skipped for the previous one
    newest = d / "step-00000003.pt"
    newest.write_bytes(newest.read_bytes()[:40])
    msgs = []
    path, st = ckpt.load_latest(tmp_path, log=msgs.append)
    assert st["step"] == 2 and "unreadable" in msgs[0]


@pytest.mark.slow
def test_training_checkpoint_is_weights_only(corpus_dir, tmp_path):
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=3"), run, log=quiet)
    path = ckpt.list_checkpoints(run)[-1]
    st = torch.load(path, weights_only=True)
    assert set(st) >= {"model", "optimizer", "scheduler", "rng", "data", "step", "tokens_seen"}
    assert all(k.split(".")[0] in ("bilm", "softmax") for k in st["model"])  # no aliases


@pytest.mark.slow
def test_compiled_bf16_training_runs_and_its_checkpoint_evaluates_eagerly(corpus_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(corpus_dir, "train.steps=3", "train.compile=true", "train.precision=bf16")
    res = run_training(cfg, run, log=quiet)
    assert math.isfinite(res["heldout"]["avg_ppl"])
    st = ckpt.load_latest(run)[1]
    assert all(k.split(".")[0] in ("bilm", "softmax") for k in st["model"])
    assert math.isfinite(evaluate(run, max_sentences=5)["avg_ppl"])


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits_0(corpus_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "elmo_pretrain.cli", "train", str(TINY), "--run-dir", str(run)]
    cmd += [
        "--set",
        f"data.path={corpus_dir}",
        "--set",
        "train.steps=100000",
        "--set",
        "train.progress=false",
    ]
    cmd += ["--set", "checkpoint.every_steps=0", "--set", "train.log_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            m = run / "metrics.jsonl"
            if m.is_file() and len(m.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "signal SIGTERM" in out
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "stop" and last["reason"] == "signal", last
    assert last["detail"] == "signal SIGTERM" and [r for r, _ in stops(run)] == ["signal"]
    (path,) = ckpt.list_checkpoints(run)
    st = ckpt.load_checkpoint(path)
    assert 3 <= st["step"] < 100000 and st["step"] == len(losses(run))


# ------------------------------------------------------------------ model pieces


def test_sampled_softmax_matches_full_when_negatives_cover_the_vocab():
    torch.manual_seed(0)
    h, t = torch.randn(64, 8), torch.randint(0, 30, (64,))
    full = LinearSoftmax(8, 30)
    every = LinearSoftmax(8, 30, n_samples=30)  # n >= V: all candidates, Q = 1: exact
    every.load_state_dict(full.state_dict())
    assert torch.allclose(every.loss(h, t, every.sample()), full.loss(h, t))
    almost = LinearSoftmax(8, 30, n_samples=28)
    almost.load_state_dict(full.state_dict())
    almost.train()
    sampled = torch.stack([almost.loss(h, t, almost.sample()).mean() for _ in range(200)]).mean()
    exact = full.loss(h, t).mean()
    assert abs(sampled - exact) / exact < 0.03, (float(sampled), float(exact))


@pytest.mark.slow
def test_distinct_token_cnn_gives_the_same_loss_and_gradients(corpus_dir):
    cfg = tiny(corpus_dir, "softmax.kind=full", "model.dropout=0.0")
    corpus = Corpus(corpus_dir)
    torch.manual_seed(0)
    lm = build_model(cfg, corpus)
    batch = BucketBatcher(
        corpus, "train", max_tokens=48, tokens_per_batch=256, pad_multiple=8, seed=0
    ).batch(0, 0)
    assert len(batch.uniq) < batch.ids.numel()
    loss, _, _ = lm(batch)
    loss.backward()
    g1 = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    chars = lm.char_table[batch.ids.reshape(-1)].long()  # the CNN on every position
    tokens = lm.bilm.token_encoder(chars).reshape(*batch.ids.shape, -1)
    loss2, _, _ = lm.core(tokens, batch.lengths, batch.targets, None)
    loss2.backward()
    assert torch.allclose(loss, loss2, atol=1e-6)
    for n, p in lm.named_parameters():
        assert torch.allclose(p.grad, g1[n], atol=1e-6), n


def test_init_range_draws_every_parameter_from_one_uniform_range(corpus_dir):
    """optim.init_range r: every weight and bias in [-r, r] and spread over it (the PTB
    literature's init); 0 keeps the modules' own, some of which reach beyond r."""
    corpus = Corpus(corpus_dir)
    torch.manual_seed(0)
    lm = build_model(tiny(corpus_dir, "optim.init_range=0.05"), corpus)
    assert not lm.bilm.token_encoder.char_embed.weight[0].any()  # the padding row stays zero
    for name, p in lm.named_parameters():
        top = float(p.detach().abs().max())
        assert top <= 0.05, name
        if p.numel() >= 100:
            assert top > 0.04 and abs(float(p.detach().mean())) < 0.01, name
    torch.manual_seed(0)
    own = build_model(tiny(corpus_dir), corpus)
    # some of the modules' own inits reach beyond r, e.g. the char embedding's N(0, 1)
    assert max(float(p.detach().abs().max()) for p in own.parameters()) > 0.5
    # an old run's config hash is the same with the option at its default
    assert config_hash(tiny(corpus_dir)) == config_hash(tiny(corpus_dir, "optim.init_range=0"))
    assert config_hash(tiny(corpus_dir)) != config_hash(tiny(corpus_dir, "optim.init_range=0.05"))
    with pytest.raises(ConfigError, match="optim.init_range"):
        tiny(corpus_dir, "optim.init_range=-1")


def test_highway_gate_bias_starts_each_highway_layer_carrying_its_input(corpus_dir):
    """optim.highway_gate_bias -2 (bilm-tf, Kim et al.): the gate half of each highway bias
    starts near -2, so the layer's output starts close to its input; the transform half and
    every other parameter are drawn as without it."""
    corpus = Corpus(corpus_dir)
    torch.manual_seed(0)
    base = build_model(tiny(corpus_dir, "optim.init_range=0.05", "model.n_highway=2"), corpus)
    torch.manual_seed(0)
    cfg = tiny(
        corpus_dir, "optim.init_range=0.05", "model.n_highway=2", "optim.highway_gate_bias=-2"
    )
    lm = build_model(cfg, corpus)
    enc, enc0 = lm.bilm.token_encoder, base.bilm.token_encoder
    for hw, hw0 in zip(enc.highways, enc0.highways, strict=True):
        half = hw.out_features // 2
        assert torch.equal(hw.bias[:half], hw0.bias[:half])  # transform: untouched
        assert torch.allclose(hw.bias[half:], hw0.bias[half:] - 2.0)
        assert torch.equal(hw.weight, hw0.weight)
    # with the gate near sigmoid(-2) = 0.12, a highway layer moves its input much less
    x = torch.rand(64, cfg.model.n_filters)
    with torch.no_grad():

        def moved(h):
            t, g = h(x).chunk(2, dim=-1)
            y = torch.sigmoid(g) * torch.relu(t) + (1 - torch.sigmoid(g)) * x
            return float((y - x).abs().mean())

        assert moved(enc.highways[0]) < 0.3 * moved(enc0.highways[0])
    assert config_hash(tiny(corpus_dir)) == config_hash(
        tiny(corpus_dir, "optim.highway_gate_bias=null")
    )
    assert config_hash(tiny(corpus_dir)) != config_hash(cfg)


def test_plain_lstm_keeps_an_identity_projection_through_training(corpus_dir, tmp_path):
    """model.lstm_projection false: h = o * tanh(c) (Kim et al.), stored as a frozen identity
    W_proj, so training, export and serving run the one LSTMP kernel unchanged."""
    with pytest.raises(ConfigError, match="model.lstm_projection"):
        tiny(corpus_dir, "model.lstm_projection=false")  # lstm_dim 32 != projection_dim 16
    cfg = tiny(
        corpus_dir,
        "model.lstm_projection=false",
        "model.lstm_dim=16",
        "optim.init_range=0.1",
        "train.steps=4",
    )
    run = tmp_path / "run"
    run_training(cfg, run, log=quiet)
    state = ckpt.load_latest(run)[1]["model"]
    projs = [k for k in state if k.endswith("w_proj.weight")]
    assert len(projs) == 2 * cfg.model.n_layers
    for k in projs:
        assert torch.equal(state[k], torch.eye(16)), k
    assert state["bilm.forward_layers.0.w_hh.weight"].abs().max() <= 0.1 + 0.05  # trained a bit
    # the hidden state of a plain LSTM stays in [-1, 1]
    _, _, lm, _ = load_run(run)
    lm.eval()
    x = torch.randn(3, 7, 16) * 10
    h, _ = lm.bilm.forward_layers[0](x)
    assert h.abs().max() <= 1.0
    # the served artifact keeps the option and the identity, and serves it
    from elmo_service.embedder import Embedder

    export(run, tmp_path / "model", evaluate_heldout=False, threads=1)
    emb = Embedder.load(tmp_path / "model", threads=1)
    assert emb.cfg.lstm_projection is False
    assert torch.equal(emb.model.backward_layers[1].w_proj.weight, torch.eye(16))
    (vecs,) = emb.embed_tokens([["a", "b", "c"]])
    assert vecs.shape == (3, 3, 32) and np.isfinite(vecs).all()


@pytest.mark.slow
def test_eval_perplexity_is_exact(corpus_dir, tmp_path):
    """`eval` vs a direct computation: elmo_service's BiLM.forward + full log-softmax, one sentence at a time."""
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=5"), run, log=quiet)
    res = evaluate(run, max_sentences=20)
    cfg, corpus, lm, _ = load_run(run)
    split = corpus.split("heldout")
    w, b = lm.softmax.weight.double(), lm.softmax.bias.double()
    p = cfg.model.projection_dim
    nf = nb = 0.0
    n = 0
    with torch.no_grad():
        for i in range(20):
            ids = [corpus.bos_id, *split.sentence(i).tolist(), corpus.eos_id]
            chars = np.stack(
                [bos_ids(50)] + [token_ids(corpus.vocab[j], 50) for j in ids[1:-1]] + [eos_ids(50)]
            )
            top = lm.bilm(torch.from_numpy(chars)[None], torch.tensor([len(ids)]))[-1, 0].double()
            logp_f = torch.log_softmax(top[:, :p] @ w.T + b, -1)
            logp_b = torch.log_softmax(top[:, p:] @ w.T + b, -1)
            tgt = [j if j < corpus.softmax_size else corpus.unk_id for j in ids]
            nf -= sum(logp_f[t, tgt[t + 1]].item() for t in range(len(ids) - 1))
            nb -= sum(logp_b[t, tgt[t - 1]].item() for t in range(1, len(ids)))
            n += len(ids) - 1
    assert res["predictions"] == n
    assert res["forward_ppl"] == pytest.approx(math.exp(nf / n), rel=1e-5)
    assert res["backward_ppl"] == pytest.approx(math.exp(nb / n), rel=1e-5)
    assert res["avg_ppl"] == pytest.approx(math.exp((nf + nb) / (2 * n)), rel=1e-5)


@pytest.mark.slow
def test_forward_only_lm_leaves_backward_layers_untouched(corpus_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(corpus_dir, "train.steps=4", "train.directions=forward")
    res = run_training(cfg, run, log=quiet)
    assert set(res["heldout"]) >= {"forward_ppl"} and "backward_ppl" not in res["heldout"]
    torch.manual_seed(cfg.train.seed)
    init = build_model(cfg, Corpus(corpus_dir)).state_dict()
    trained = ckpt.load_latest(run)[1]["model"]
    assert all(
        torch.equal(init[k], trained[k]) for k in init if k.startswith("bilm.backward_layers")
    )
    assert not torch.equal(
        init["bilm.forward_layers.0.w_hh.weight"], trained["bilm.forward_layers.0.w_hh.weight"]
    )


@pytest.mark.slow
def test_adaptive_softmax_and_adagrad_train_and_eval_exactly(corpus_dir, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(
        corpus_dir,
        "train.steps=4",
        "softmax.kind=adaptive",
        "softmax.cutoffs=[20, 80]",
        "optim.name=adagrad",
        "optim.lr=0.2",
    )
    res = run_training(cfg, run, log=quiet)
    assert math.isfinite(res["heldout"]["avg_ppl"])
    _, _, lm, _ = load_run(run)
    probs = lm.softmax.log_probs(torch.randn(5, 16)).exp().sum(-1)
    assert torch.allclose(probs, torch.ones(5), atol=1e-5)


@pytest.mark.slow
def test_adaptive_softmax_trains_under_bf16_autocast(corpus_dir, tmp_path):
    # nn.AdaptiveLogSoftmaxWithLoss index_copy_s bf16 cluster outputs into a
    # float32 buffer under autocast; the softmax must run in fp32 inside it
    cfg = tiny(
        corpus_dir,
        "train.steps=3",
        "train.precision=bf16",
        "softmax.kind=adaptive",
        "softmax.cutoffs=[20, 80]",
    )
    res = run_training(cfg, tmp_path / "run", log=quiet)
    assert math.isfinite(res["heldout"]["avg_ppl"])
    _, _, lm, _ = load_run(tmp_path / "run")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = lm.softmax.log_probs(torch.randn(4, 16))
    assert logp.dtype == torch.float32
    assert torch.allclose(logp.exp().sum(-1), torch.ones(4), atol=1e-5)


def _tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_scalars_mirror_the_metrics_log(corpus_dir, tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=10", "train.log_every=5"), run, log=quiet)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = _tb_scalars(run / "tensorboard")
    for key, tag in [("loss", "train/loss"), ("ppl", "train/perplexity"), ("lr", "train/learning_rate"),
                     ("tok_s", "train/tokens_per_s"), ("grad_norm", "train/grad_norm")]:  # fmt: skip
        want = [(r["step"], r[key]) for r in recs if key in r]
        assert [s for s, _ in got[tag]] == [5, 10], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want], rel=1e-6), tag
    heldout = next(r["heldout"] for r in recs if "heldout" in r)
    assert got["heldout/avg_ppl"] == [(10, pytest.approx(heldout["avg_ppl"], rel=1e-6))]


@pytest.mark.slow
def test_without_tensorboard_only_the_metrics_log_is_written(corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=5", "train.log_every=5"), run, log=quiet)
    assert not (run / "tensorboard").exists() and losses(run)


@pytest.mark.slow
def test_plot_draws_a_learning_curve_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = ROOT / "docs" / "logs" / "ptb-metrics.jsonl"
    out = tmp_path / "curve.png"
    assert main(["plot", str(log), "--out", str(out)]) == 0
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    from matplotlib.image import imread

    img = imread(out)
    assert img.shape[0] >= 600 and img.shape[1] >= 900 and img[..., :3].std() > 0.05
    assert str(out) in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = main(
        [
            "plot",
            str(ROOT / "docs" / "logs" / "ptb-metrics.jsonl"),
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "elmo-service[plot]" in err
    assert not (tmp_path / "c.png").exists()


def test_resume_keeps_a_fp32_run_in_fp32_where_auto_would_pick_bf16(
    corpus_dir, tmp_path, monkeypatch
):
    """precision auto resolves per machine; a run that trained in fp32 and is resumed on a
    machine with native bf16 goes on in fp32 (its arithmetic does not change mid-run), while
    a bf16 run moved to a machine without native bf16 goes on in fp32 (not emulated bf16)."""
    import elmo_pretrain.train as train_mod

    run = tmp_path / "run"
    sets = ("train.steps=4", "train.precision=auto", "checkpoint.every_steps=2")
    # auto as an AVX2 CPU resolves it, then as a machine with native bf16
    monkeypatch.setattr(train_mod, "resolve_precision", lambda device, p: "fp32")
    run_training(tiny(corpus_dir, *sets), run, stop_after=2, log=quiet)
    assert ckpt.load_latest(run)[1]["precision"] == "fp32"
    lines: list[str] = []
    monkeypatch.setattr(train_mod, "resolve_precision", lambda device, p: "bf16")
    run_training(tiny(corpus_dir, *sets), run, resume=True, log=lines.append)
    assert any("trained in fp32, so it goes on in fp32" in x for x in lines), lines
    assert ckpt.load_latest(run)[1]["precision"] == "fp32"

    # the other way: a checkpoint written in bf16, resumed where auto picks fp32
    other = tmp_path / "other"
    run_training(tiny(corpus_dir, *sets), other, stop_after=2, log=quiet)  # bf16 (patched)
    assert ckpt.load_latest(other)[1]["precision"] == "bf16"
    monkeypatch.setattr(train_mod, "resolve_precision", lambda device, p: "fp32")
    lines.clear()
    run_training(tiny(corpus_dir, *sets), other, resume=True, log=lines.append)
    assert any("trained in bf16; here it goes on in fp32" in x for x in lines), lines
    assert ckpt.load_latest(other)[1]["precision"] == "fp32"


def test_eval_of_a_missing_or_empty_file_is_one_line_naming_it(tmp_path, capsys):
    """A --file that is missing, a folder or empty: exit 2 and one line, never a traceback."""
    bundled = ROOT / "models" / "ptb"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for given, words in [
        (tmp_path / "missing.txt", "not a file"),
        (tmp_path, "not a file"),
        (empty, "no sentences"),
    ]:
        capsys.readouterr()
        assert main(["eval", str(bundled), "--file", str(given)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("elmo-pretrain eval: error: ") and words in err, err
        assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_eval_finds_a_relative_corpus_from_another_folder_and_checks_its_arguments(
    corpus_dir, tmp_path, monkeypatch
):
    """A run made with a relative data.path is scored from any working directory (the corpus
    path it recorded when it started); a negative --max-sentences and an exported LM without
    --file are refused naming the argument."""
    from elmo_service.errors import InputError

    monkeypatch.chdir(corpus_dir.parent)
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, f"data.path={corpus_dir.name}", "train.steps=2"), run, log=quiet)
    here = evaluate(run, max_sentences=20)
    monkeypatch.chdir(tmp_path)  # the relative path now points nowhere
    assert evaluate(run, max_sentences=20)["forward_ppl"] == pytest.approx(here["forward_ppl"])
    with pytest.raises(InputError) as e:
        evaluate(run, max_sentences=-1)
    assert e.value.field == "max_sentences"
    # --checkpoint: a file, a checkpoint's name or a step number
    by_step = evaluate(run, checkpoint="2", max_sentences=20)
    assert by_step["checkpoint"] == "step-00000002.pt"
    assert by_step["forward_ppl"] == pytest.approx(here["forward_ppl"])
    with pytest.raises(ConfigError) as e:
        evaluate(run, checkpoint="7")
    assert e.value.field == "checkpoint" and "step-00000002.pt" in e.value.message
    lm = tmp_path / "lm"
    assert main(["export", str(run), str(lm), "--lm"]) == 0
    with pytest.raises(InputError) as e:
        evaluate(lm)
    assert e.value.field == "file" and "--file" in e.value.message
