"""Published ELMo weights: conversion, export, and parity with AllenNLP 2.10.

The reference is AllenNLP's own ``_ElmoBiLm`` (and ``batch_to_ids``), run on
random-weight bilm-tf files from ``tests/support/bilm_fixtures.py``. AllenNLP is
installed by ``tests/install_parity_deps.sh`` (CI runs it via ``make setup``);
these tests FAIL when it is missing. ``tests/support/allennlp_shim.py`` stands in only
for packages AllenNLP imports but its ELMo code path never executes.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo_service.artifact import load_artifact, read_config
from elmo_service.bilm.char_ids import batch_ids, sentence_ids
from elmo_service.bilm.model import BiLM
from elmo_service.convert import (
    config_from_options,
    convert_bilm,
    export_bilm,
    load_bilm,
    state_dict_from_bilm,
)
from elmo_service.embedder import Embedder
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tokenizers import WordTokenizer
from tests.support.bilm_fixtures import bilm_options, edit_hdf5, write_bilm
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece
from tests.support.reference import reference_bilm

pytestmark = pytest.mark.slow  # imports AllenNLP and runs it beside ours

TOL = 1e-4

SENTENCES = [
    ["The", "bank", "of", "the", "river", "flooded", "again", "this", "year", "."],
    ["naïve", "café", "日本語", "😀", "Straße"],
    ["a"],
    [],
    ["x" * 60, "é" * 30, "don't", "<S>", "!", "well-known", "3.14"],
]

TRICKY_TOKENS = [
    "",
    " ",
    "\u200b",
    "\ud800",  # lone surrogate: dropped by encode(..., "ignore")
    "a\ud800b",
    "naïve",
    "日本語",
    "😀",
    "x" * 47,
    "x" * 48,
    "x" * 49,
    "x" * 200,
    "é" * 30,  # 60 bytes: cut at 48
    "a" + "é" * 30,  # cut inside a two-byte character
    "😀" * 13,  # cut inside a four-byte character
    "<S>",
    "</S>",
    "<s>",
    "\x00",
    "\n",
    "@@PADDING@@",
    "@@UNKNOWN@@",
]


# --------------------------------------------------------------------------- AllenNLP
@pytest.fixture(scope="module")
def allennlp_elmo():
    """``allennlp.modules.elmo``; a missing AllenNLP fails, it never skips."""
    from tests.support.allennlp_shim import import_allennlp_elmo

    try:
        return import_allennlp_elmo()
    except ImportError as e:  # pragma: no cover - the message is the point
        pytest.fail(
            f"AllenNLP is not importable ({e}); run `bash tests/install_parity_deps.sh .venv/bin/pip`",
            pytrace=False,
        )


def allennlp_layers(
    elmo, options: Path, weights: Path, sentences
) -> tuple[torch.Tensor, torch.Tensor]:
    """AllenNLP's ``_ElmoBiLm`` right after ``reset_states()``: ``[L+1, B, T+2, 2P]`` and mask."""
    bilm = elmo._ElmoBiLm(str(options), str(weights))
    bilm.eval()
    bilm._elmo_lstm.reset_states()
    with torch.no_grad():
        out = bilm(elmo.batch_to_ids(sentences))
    return torch.stack(out["activations"]), out["mask"]


def our_layers(model: BiLM, sentences) -> torch.Tensor:
    ids, lengths = batch_ids(sentences, model.cfg.max_chars_per_token)
    with torch.no_grad():
        return model(torch.from_numpy(ids), torch.from_numpy(lengths))


def per_layer_diff(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    assert a.shape == b.shape
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def test_allennlp_is_the_real_package(allennlp_elmo):
    import allennlp
    import allennlp.modules.elmo_lstm as elmo_lstm

    from tests.support.allennlp_shim import stubs_in_use

    assert allennlp.__version__ == "2.10.1"
    assert Path(allennlp.__file__).parent.parent.name == "site-packages"
    assert allennlp_elmo._ElmoBiLm.__module__ == "allennlp.modules.elmo"
    assert torch.__version__.startswith("2.13.0")
    # nothing the ELMo math lives in is a stand-in
    stubbed_roots = {name.split(".")[0] for name in stubs_in_use()}
    assert not stubbed_roots & {"allennlp", "torch", "numpy", "h5py", "cached_path"}
    assert (
        elmo_lstm.LstmCellWithProjection.__module__ == "allennlp.modules.lstm_cell_with_projection"
    )


@pytest.mark.parametrize("n_characters", [261, 262])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("n_highway", [0, 1, 2])
def test_converted_model_matches_allennlp(
    allennlp_elmo, tmp_path, n_characters, activation, n_highway
):
    options, weights = write_bilm(
        tmp_path / "src",
        n_characters=n_characters,
        activation=activation,
        n_highway=n_highway,
        seed=n_highway,
    )
    ref, mask = allennlp_layers(allennlp_elmo, options, weights, SENTENCES)
    convert_bilm(options, weights, tmp_path / "model")
    model = load_artifact(tmp_path / "model").model
    ours = our_layers(model, SENTENCES)
    diffs = per_layer_diff(ours, ref)
    print(f"parity n_characters={n_characters} {activation} n_highway={n_highway}: {diffs}")
    assert max(diffs) <= TOL, diffs
    # the same masks: padding rows are zero in both
    lengths = torch.tensor([len(s) + 2 for s in SENTENCES])
    assert torch.equal(mask, torch.arange(mask.shape[1])[None] < lengths[:, None])
    # the fixture carries signal through every layer (nothing saturated or clipped away)
    real = ref[:, mask]
    assert all(float(layer.std()) > 0.1 for layer in real)
    assert float((real[1:].abs() >= 2.999).float().mean()) < 0.01


@pytest.mark.parametrize(
    "mistake",
    [
        "char_embed_as_is",
        "no_forget_bias",
        "gates_f_o_swapped",
        "highway_not_transposed",
        "conv_flipped",
    ],
)
def test_parity_check_catches_mapping_mistakes(allennlp_elmo, tmp_path, mistake):
    """Each plausible conversion slip moves the output far beyond the tolerance."""
    options, weights = write_bilm(tmp_path, n_characters=262, n_highway=1)
    ref, _ = allennlp_layers(allennlp_elmo, options, weights, SENTENCES)
    model, _ = load_bilm(options, weights)
    sd = model.state_dict()
    c = model.cfg.lstm_dim
    with h5py.File(weights) as f:
        char_embed = torch.from_numpy(f["char_embed"][...])
    with torch.no_grad():
        if mistake == "char_embed_as_is":  # 262 rows taken without AllenNLP's zero row
            sd["token_encoder.char_embed.weight"].copy_(char_embed)
        elif mistake == "no_forget_bias":
            sd["forward_layers.0.w_ih.bias"][c : 2 * c] -= 1.0
        elif mistake == "gates_f_o_swapped":
            w = sd["backward_layers.1.w_hh.weight"]
            w.copy_(torch.cat([w[:c], w[2 * c : 3 * c], w[c : 2 * c], w[3 * c :]]))
        elif mistake == "highway_not_transposed":
            w = sd["token_encoder.highways.0.weight"]
            f = w.shape[1]
            w.copy_(torch.cat([w[:f].t(), w[f:].t()]))
        elif mistake == "conv_flipped":
            w = sd["token_encoder.convs.2.weight"]
            w.copy_(w.flip(-1))
    assert max(per_layer_diff(our_layers(model, SENTENCES), ref)) > 100 * TOL


def test_char_ids_equal_allennlp_batch_to_ids(allennlp_elmo):
    theirs = allennlp_elmo.batch_to_ids([TRICKY_TOKENS]).numpy()[0]
    ours = batch_ids([TRICKY_TOKENS])[0][0, 1:-1]
    for token, a, b in zip(TRICKY_TOKENS, theirs, ours, strict=True):
        assert a.tolist() == b.tolist(), repr(token)
    # whole batches too: sentences of different lengths, padded with zero rows
    theirs = allennlp_elmo.batch_to_ids(SENTENCES).numpy()
    ids, lengths = batch_ids(SENTENCES)
    for b, sentence in enumerate(SENTENCES):
        assert np.array_equal(ids[b, 1 : lengths[b] - 1], theirs[b, : len(sentence)])
        assert not theirs[b, len(sentence) :].any()
    # and the sentence markers AllenNLP adds inside _ElmoCharacterEncoder
    mapper = allennlp_elmo.ELMoCharacterMapper
    assert sentence_ids([])[0].tolist() == [c + 1 for c in mapper.beginning_of_sentence_characters]
    assert sentence_ids([])[1].tolist() == [c + 1 for c in mapper.end_of_sentence_characters]


def test_embedder_on_converted_model_matches_allennlp(allennlp_elmo, tmp_path):
    options, weights = write_bilm(tmp_path / "src", n_characters=262, n_highway=2, seed=3)
    convert_bilm(options, weights, tmp_path / "model")
    texts = [
        "The bank of the river flooded again, didn't it?",
        "Naïve café-goers don't pay 3.14 € for it.",
        "",
        "Wow!",
        "A much longer sentence, with commas, dots... and well-known hyphenated words that go on and on.",
    ]
    embedder = Embedder.load(tmp_path / "model", device="cpu", batch_tokens=40)  # several batches
    got = embedder.embed(texts)
    tokens = [[t.text for t in WordTokenizer()(text)] for text in texts]
    assert [[t.text for t in e.tokens] for e in got] == tokens
    ref, mask = allennlp_layers(allennlp_elmo, options, weights, tokens)
    worst = 0.0
    for b, emb in enumerate(got):
        n = len(tokens[b])
        want = ref[:, b, 1 : n + 1].numpy()  # AllenNLP's remove_sentence_boundaries
        assert emb.layers.shape == want.shape
        if n:
            worst = max(worst, float(np.abs(emb.layers - want).max()))
    print(f"embedder vs AllenNLP: {worst}")
    assert worst <= TOL


def test_exported_model_runs_in_allennlp(allennlp_elmo, tmp_path):
    """Our own (randomly initialised) model, exported, gives the same layers in AllenNLP."""
    model_dir = tiny_artifact(tmp_path / "ours", cell_clip=3.0, proj_clip=3.0)
    export_bilm(model_dir, tmp_path / "out" / "options.json", tmp_path / "out" / "weights.hdf5")
    ref, _ = allennlp_layers(
        allennlp_elmo,
        tmp_path / "out" / "options.json",
        tmp_path / "out" / "weights.hdf5",
        SENTENCES,
    )
    ours = our_layers(load_artifact(model_dir).model, SENTENCES)
    assert max(per_layer_diff(ours, ref)) <= TOL


def test_allennlp_refuses_models_without_skip_connections(allennlp_elmo, tmp_path):
    options, weights = write_bilm(tmp_path, use_skip_connections=None)
    with pytest.raises(Exception, match="residual"):
        allennlp_elmo._ElmoBiLm(str(options), str(weights))


# --------------------------------------------------------------------------- independent reference
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def bilm_tf_reference(options: dict, weights: Path, tokens: list[str]) -> np.ndarray:
    """bilm-tf's computation, straight from the HDF5 layout, float64, one sentence.

    Written from the format description (not from our model or AllenNLP) so it
    can check ``use_skip_connections`` false, which AllenNLP cannot load.
    Returns ``[L+1, T+2, 2P]`` including the sentence markers.
    """
    cnn, lstm = options["char_cnn"], options["lstm"]
    act = np.tanh if cnn["activation"] == "tanh" else (lambda v: np.maximum(v, 0.0))
    with h5py.File(weights) as f:
        a = {name: np.asarray(f[name][...], dtype=np.float64) for name in _datasets(f)}
    table = np.vstack([np.zeros((1, a["char_embed"].shape[1])), a["char_embed"]])
    x = table[sentence_ids(tokens)]  # [T, 50, d]
    feats = []
    for i, (w, _) in enumerate(cnn["filters"]):
        kernel = a[f"CNN/W_cnn_{i}"][0]  # [w, d, n]
        conv = (
            sum(x[:, k : x.shape[1] - w + 1 + k] @ kernel[k] for k in range(w))
            + a[f"CNN/b_cnn_{i}"]
        )
        feats.append(act(conv.max(axis=1)))
    h = np.concatenate(feats, axis=-1)
    for k in range(cnn.get("n_highway", 0)):
        carry = _sigmoid(h @ a[f"CNN_high_{k}/W_carry"] + a[f"CNN_high_{k}/b_carry"])
        transform = np.maximum(
            h @ a[f"CNN_high_{k}/W_transform"] + a[f"CNN_high_{k}/b_transform"], 0.0
        )
        h = carry * transform + (1.0 - carry) * h
    e = h @ a["CNN_proj/W_proj"] + a["CNN_proj/b_proj"]
    outputs = {0: [], 1: []}
    for direction in (0, 1):
        seq = e if direction == 0 else e[::-1]
        for layer in range(lstm["n_layers"]):
            pre = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            c = np.zeros(lstm["dim"])
            hp = np.zeros(lstm["projection_dim"])
            out = []
            for t in range(seq.shape[0]):
                gates = np.concatenate([seq[t], hp]) @ a[f"{pre}/W_0"] + a[f"{pre}/B"]
                i, j, fg, o = np.split(gates, 4)
                c = np.clip(
                    _sigmoid(fg + 1.0) * c + _sigmoid(i) * np.tanh(j),
                    -lstm["cell_clip"],
                    lstm["cell_clip"],
                )
                hp = np.clip(
                    (_sigmoid(o) * np.tanh(c)) @ a[f"{pre}/W_P_0"],
                    -lstm["proj_clip"],
                    lstm["proj_clip"],
                )
                out.append(hp)
            out = np.stack(out)
            if lstm.get("use_skip_connections") and layer > 0:
                out = out + seq
            seq = out
            outputs[direction].append(out if direction == 0 else out[::-1])
    layers = [np.concatenate([e, e], axis=-1)]
    layers += [np.concatenate([f, b], axis=-1) for f, b in zip(outputs[0], outputs[1], strict=True)]
    return np.stack(layers)


def _datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def test_reference_matches_allennlp(allennlp_elmo, tmp_path):
    """The float64 reference is right where AllenNLP can judge it."""
    options, weights = write_bilm(tmp_path, n_characters=261, activation="tanh", n_highway=2)
    ref, _ = allennlp_layers(allennlp_elmo, options, weights, SENTENCES[:1])
    want = bilm_tf_reference(json.loads(options.read_text()), weights, SENTENCES[0])
    assert np.abs(ref[:, 0].numpy() - want).max() <= TOL


def test_the_bilm_tf_oracle_agrees_with_the_one_reference(tmp_path):
    """The external check (numpy, from the hdf5) and the tests' own textbook biLM
    (tests/support/reference.py, on the converted weights) are the same function."""
    options, weights = write_bilm(tmp_path, n_characters=261, activation="tanh", n_highway=2)
    model, _ = load_bilm(options, weights)
    opts = json.loads(options.read_text())
    for sentence in SENTENCES:
        want = bilm_tf_reference(opts, weights, sentence)
        got = reference_bilm(model, sentence, dtype=torch.float64).numpy()
        assert np.abs(got - want).max() <= TOL


@pytest.mark.parametrize("skip", [False, None])
def test_without_skip_connections_matches_bilm_tf(tmp_path, skip):
    """``use_skip_connections`` false or absent (bilm-tf: ``.get`` -> None) means no residual."""
    options, weights = write_bilm(tmp_path, use_skip_connections=skip, n_layers=3)
    model, _ = load_bilm(options, weights)
    assert model.cfg.residual is False
    ours = our_layers(model, SENTENCES)
    opts = json.loads(options.read_text())
    for b, sentence in enumerate(SENTENCES):
        want = bilm_tf_reference(opts, weights, sentence)
        assert np.abs(ours[:, b, : len(sentence) + 2].numpy() - want).max() <= TOL
    # and it is a different function from the residual one
    opts["lstm"]["use_skip_connections"] = True
    assert (
        np.abs(ours[:, 0, :12].numpy() - bilm_tf_reference(opts, weights, SENTENCES[0])).max()
        > 1e-2
    )


# --------------------------------------------------------------------------- converter
def test_provenance_and_tokenizer(tmp_path):
    options, weights = write_bilm(tmp_path / "src", n_characters=262)
    version = convert_bilm(options, weights, tmp_path / "model", lowercase=True)
    art = load_artifact(tmp_path / "model")
    assert art.version == version
    assert art.tokenizer.kind == "word" and art.tokenizer.lowercase is True
    prov = art.provenance
    assert prov["source"] == "converted from bilm-tf"
    import hashlib

    for key, path in (("options", options), ("weights", weights)):
        assert prov["source_files"][key] == {
            "name": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    assert prov["char_embed_rows"] == 262
    assert read_config(tmp_path / "model")["model"]["residual"] is True
    # converting the same files again gives the same version; a non-empty target is refused
    with pytest.raises(ArtifactError, match="overwrite"):
        convert_bilm(options, weights, tmp_path / "model")
    assert (
        convert_bilm(options, weights, tmp_path / "model", lowercase=True, overwrite=True)
        == version
    )


def test_char_embed_row_zero_is_padding(tmp_path):
    options, weights = write_bilm(tmp_path, n_characters=261)
    model, _ = load_bilm(options, weights)
    table = model.token_encoder.char_embed.weight.detach()
    with h5py.File(weights) as f:
        file_rows = torch.from_numpy(f["char_embed"][...])
    assert not table[0].any()
    assert torch.equal(table[1:], file_rows)


@pytest.mark.parametrize(
    "dataset",
    [
        "char_embed",
        "CNN/W_cnn_1",
        "CNN/b_cnn_2",
        "CNN_high_0/W_carry",
        "CNN_high_1/b_transform",
        "CNN_proj/W_proj",
        "RNN_0/RNN/MultiRNNCell/Cell1/LSTMCell/W_0",
        "RNN_1/RNN/MultiRNNCell/Cell0/LSTMCell/B",
        "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0",
    ],
)
def test_missing_dataset_is_named(tmp_path, dataset):
    options, weights = write_bilm(tmp_path / "src", n_highway=2)
    expected = config_expected_shape(options, dataset)
    edit_hdf5(weights, delete=(dataset,))
    with pytest.raises(ArtifactError) as info:
        convert_bilm(options, weights, tmp_path / "model")
    assert dataset in info.value.message and expected in info.value.message
    assert info.value.field == dataset
    assert not (tmp_path / "model").exists()


def config_expected_shape(options: Path, dataset: str) -> str:
    from elmo_service.convert import expected_datasets

    shape = expected_datasets(config_from_options(json.loads(options.read_text())))[dataset]
    return "[" + ", ".join(map(str, shape)) + "]"


@pytest.mark.parametrize(
    ("dataset", "bad_shape", "expected"),
    [
        ("CNN/W_cnn_2", (1, 3, 4, 15), "[1, 3, 4, 16]"),
        ("CNN/W_cnn_0", (1, 4, 4), "[1, 1, 4, 4]"),
        ("CNN_high_0/W_transform", (28, 27), "[28, 28]"),
        ("CNN_proj/b_proj", (17,), "[16]"),
        ("RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0", (16, 128), "[32, 128]"),
        ("RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0", (16, 32), "[32, 16]"),
        ("char_embed", (263, 4), "[261 or 262, 4]"),
        ("char_embed", (261, 5), "[261 or 262, 4]"),
    ],
)
def test_wrong_shape_names_tensor_and_expected_shape(tmp_path, dataset, bad_shape, expected):
    options, weights = write_bilm(tmp_path / "src")
    edit_hdf5(weights, replace={dataset: np.zeros(bad_shape, dtype=np.float32)})
    with pytest.raises(ArtifactError) as info:
        convert_bilm(options, weights, tmp_path / "model")
    msg = info.value.message
    assert dataset in msg and expected in msg and "[" + ", ".join(map(str, bad_shape)) + "]" in msg


def test_wrong_dtype_and_bad_values_are_named(tmp_path):
    options, weights = write_bilm(tmp_path)
    edit_hdf5(weights, replace={"CNN/b_cnn_0": np.zeros(4, dtype=np.int32)})
    with pytest.raises(ArtifactError, match=r"'CNN/b_cnn_0' has dtype int32, expected float32"):
        load_bilm(options, weights)
    nan = np.zeros(16, dtype=np.float32)
    nan[3] = np.nan
    edit_hdf5(
        weights, replace={"CNN/b_cnn_0": np.zeros(4, dtype=np.float64), "CNN_proj/b_proj": nan}
    )
    with pytest.raises(ArtifactError, match=r"'CNN_proj/b_proj' holds NaN"):
        load_bilm(options, weights)


def test_unreadable_files(tmp_path):
    options, weights = write_bilm(tmp_path)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_bilm(options, tmp_path / "nope.hdf5")
    junk = tmp_path / "junk.hdf5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(ArtifactError, match="not a readable HDF5 file"):
        load_bilm(options, junk)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_bilm(bad_json, weights)
    with pytest.raises(ConfigError, match="does not exist"):
        load_bilm(tmp_path / "none.json", weights)


def _edit(options: dict, path: str, value) -> dict:
    node = options
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return options


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("char_cnn.activation", "sigmoid", "char_cnn.activation"),
        ("char_cnn.filters", [[1, 4], [2]], "char_cnn.filters"),
        ("char_cnn.filters", [], "char_cnn.filters"),
        ("char_cnn.filters", [[60, 4]], "filters"),  # wider than a token
        ("char_cnn.embedding", KeyError, "char_cnn.embedding.dim"),
        ("char_cnn.n_characters", 300, "char_cnn.n_characters"),
        ("char_cnn.n_highway", -1, "n_highway"),
        ("char_cnn", KeyError, "char_cnn"),
        ("lstm", KeyError, "lstm"),
        ("lstm.dim", KeyError, "lstm.dim"),
        ("lstm.projection_dim", "16", "lstm.projection_dim"),
        ("lstm.n_layers", 0, "n_layers"),
        ("lstm.cell_clip", -3, "lstm.cell_clip"),
        ("lstm.use_skip_connections", "yes", "lstm.use_skip_connections"),
        ("bidirectional", False, "bidirectional"),
    ],
)
def test_bad_options_raise_config_error(path, value, field):
    with pytest.raises(ConfigError) as info:
        config_from_options(_edit(bilm_options(), path, value))
    assert info.value.field == field


def test_lenient_options():
    opts = bilm_options(use_skip_connections=None, n_highway=0, clip=None)
    del opts["char_cnn"]["n_highway"], opts["dropout"], opts["char_cnn"]["n_characters"]
    cfg = config_from_options(opts)
    assert (cfg.residual, cfg.n_highway, cfg.cell_clip, cfg.proj_clip) == (False, 0, None, None)
    assert config_from_options(bilm_options(activation="tanh")).activation == "tanh"
    with pytest.raises(ConfigError):
        config_from_options([1, 2])


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("n_characters", [261, 262])
def test_round_trip_ours_to_bilm_tf_to_ours(tmp_path, n_characters):
    options, weights = write_bilm(
        tmp_path / "src", n_characters=n_characters, n_highway=2, activation="tanh"
    )
    v1 = convert_bilm(options, weights, tmp_path / "a")
    export_bilm(
        tmp_path / "a", tmp_path / "out" / "options.json", tmp_path / "out" / "weights.hdf5"
    )
    # the exported file is the source, in the canonical 261-row form
    with h5py.File(weights) as src, h5py.File(tmp_path / "out" / "weights.hdf5") as out:
        assert sorted(_datasets(src)) == sorted(_datasets(out))
        for name in _datasets(src):
            want = src[name][...][:261] if name == "char_embed" else src[name][...]
            assert out[name].dtype == np.float32
            np.testing.assert_allclose(out[name][...], want, rtol=0, atol=1e-6, err_msg=name)
    exported = json.loads((tmp_path / "out" / "options.json").read_text())
    assert config_from_options(exported) == config_from_options(json.loads(options.read_text()))
    assert exported["char_cnn"]["n_characters"] == 262 and exported["elmo_service"]["version"] == v1
    convert_bilm(
        tmp_path / "out" / "options.json", tmp_path / "out" / "weights.hdf5", tmp_path / "b"
    )
    a, b = load_artifact(tmp_path / "a").model, load_artifact(tmp_path / "b").model
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert torch.equal(our_layers(a, SENTENCES), our_layers(b, SENTENCES))


def test_round_trip_of_our_own_model(tmp_path):
    """Ours -> bilm-tf -> ours keeps every weight (row 0 of char_embed aside) and every output."""
    model_dir = tiny_artifact(tmp_path / "ours", n_highway=2, residual=False)
    export_bilm(model_dir, tmp_path / "o.json", tmp_path / "w.hdf5")
    convert_bilm(tmp_path / "o.json", tmp_path / "w.hdf5", tmp_path / "back")
    a, b = load_artifact(model_dir).model, load_artifact(tmp_path / "back").model
    assert a.cfg.replace(max_sentence_tokens=512) == b.cfg  # a serving limit, not in bilm-tf
    for name, tensor in a.state_dict().items():
        if name == "token_encoder.char_embed.weight":
            tensor = tensor[1:]  # row 0 (batch padding) is never read for a real token
            other = b.state_dict()[name][1:]
        else:
            other = b.state_dict()[name]
        # gate biases pass through -1.0 and +1.0: equal up to one rounding
        torch.testing.assert_close(tensor, other, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(
        our_layers(a, SENTENCES), our_layers(b, SENTENCES), rtol=0, atol=1e-5
    )


def test_export_refuses_subword_models_unless_asked(tmp_path):
    sp = train_sentencepiece(tmp_path)
    model_dir = tiny_artifact(tmp_path / "sp_model", tokenizer=sp)
    with pytest.raises(ConfigError, match="allow_subword"):
        export_bilm(model_dir, tmp_path / "o.json", tmp_path / "w.hdf5")
    assert not (tmp_path / "w.hdf5").exists()
    export_bilm(model_dir, tmp_path / "o.json", tmp_path / "w.hdf5", allow_subword=True)
    assert (
        json.loads((tmp_path / "o.json").read_text())["elmo_service"]["tokenizer"]["type"]
        == "sentencepiece"
    )


def test_state_dict_names_match_the_model():
    opts = bilm_options(n_highway=2)
    cfg = config_from_options(opts)
    from tests.support.bilm_fixtures import bilm_arrays

    sd = state_dict_from_bilm(bilm_arrays(opts), cfg)
    ref = BiLM(cfg).state_dict()
    assert sorted(sd) == sorted(ref)
    assert all(sd[k].shape == ref[k].shape and sd[k].dtype == torch.float32 for k in ref)
