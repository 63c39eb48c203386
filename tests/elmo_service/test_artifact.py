"""Artifacts load exactly what was saved, and refuse anything else by name."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from elmo_service.artifact import (
    MANIFEST,
    WEIGHTS,
    load_artifact,
    save_artifact,
    sha256_file,
    version_of,
)
from elmo_service.errors import ArtifactError
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_artifact, tiny_model, train_sentencepiece


def _refresh_manifest(d):
    """Re-hash after a deliberate edit, so the test reaches the deeper check."""
    m = json.loads((d / MANIFEST).read_text())
    m["files"] = {name: sha256_file(d / name) for name in m["files"]}
    m["version"] = version_of(m["files"])
    (d / MANIFEST).write_text(json.dumps(m))


def test_round_trip_same_outputs_and_stable_version(tmp_path):
    model = tiny_model()
    sp = train_sentencepiece(tmp_path)
    v1 = save_artifact(model, sp, tmp_path / "a", provenance={"corpus": "x"})
    v2 = save_artifact(model, sp, tmp_path / "b", provenance={"corpus": "x"})
    assert v1 == v2 and len(v1) == 16
    art = load_artifact(tmp_path / "a")
    assert art.version == v1 and art.provenance == {"corpus": "x"}
    assert art.tokenizer.fingerprint == sp.fingerprint
    for (k, a), (_, b) in zip(
        model.state_dict().items(), art.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    # a different model is a different version
    assert save_artifact(tiny_model(seed=1), sp, tmp_path / "c") != v1


def test_weights_are_safetensors_not_pickle(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    head = (d / WEIGHTS).read_bytes()[:8]
    n = int.from_bytes(head, "little")  # safetensors: u64 header length, then JSON
    assert (d / WEIGHTS).read_bytes()[8 : 8 + n].startswith(b"{")


def test_refuses_to_overwrite(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    with pytest.raises(ArtifactError, match="not empty"):
        save_artifact(tiny_model(), WordTokenizer(), d)
    save_artifact(tiny_model(seed=3), WordTokenizer(), d, overwrite=True)
    load_artifact(d)


@pytest.mark.parametrize("name", ["config.json", "weights.safetensors", "manifest.json"])
def test_missing_file_is_named(tmp_path, name):
    d = tiny_artifact(tmp_path / "m")
    (d / name).unlink()
    with pytest.raises(ArtifactError, match=name.replace(".", r"\.")):
        load_artifact(d)


def test_missing_tokenizer_file_is_named(tmp_path):
    d = tmp_path / "m"
    save_artifact(tiny_model(), train_sentencepiece(tmp_path), d)
    (d / "tokenizer.model").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer\.model"):
        load_artifact(d)


def test_corrupt_weights_detected_by_hash(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    data = bytearray((d / WEIGHTS).read_bytes())
    data[-5] ^= 0xFF
    (d / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors is corrupt"):
        load_artifact(d)


def test_truncated_weights_named_even_with_matching_manifest(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:100])
    _refresh_manifest(d)
    with pytest.raises(ArtifactError, match=r"corrupt weights\.safetensors"):
        load_artifact(d)


def _edit_weights(d, fn):
    state = load_file(str(d / WEIGHTS))
    fn(state)
    save_file(state, str(d / WEIGHTS))
    _refresh_manifest(d)


def test_wrong_shape_names_tensor_and_expected_shape(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    _edit_weights(d, lambda s: s.__setitem__("token_encoder.projection.bias", torch.zeros(3)))
    with pytest.raises(
        ArtifactError, match=r"'token_encoder\.projection\.bias' has shape \[3\], expected \[8\]"
    ):
        load_artifact(d)


def test_missing_and_unexpected_tensors_named(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    _edit_weights(d, lambda s: s.pop("forward_layers.1.w_hh.weight"))
    with pytest.raises(ArtifactError, match=r"lack tensor 'forward_layers\.1\.w_hh\.weight'"):
        load_artifact(d)
    d2 = tiny_artifact(tmp_path / "m2")
    _edit_weights(d2, lambda s: s.__setitem__("softmax.weight", torch.zeros(2)))
    with pytest.raises(ArtifactError, match="unexpected tensor 'softmax.weight'"):
        load_artifact(d2)


def test_wrong_dtype_named(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    _edit_weights(
        d,
        lambda s: s.__setitem__("token_encoder.projection.bias", torch.zeros(8, dtype=torch.int32)),
    )
    with pytest.raises(ArtifactError, match="dtype"):
        load_artifact(d)


def test_schema_version_and_bad_config_named(tmp_path):
    d = tiny_artifact(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["schema_version"] = 99
    (d / "config.json").write_text(json.dumps(cfg))
    _refresh_manifest(d)
    with pytest.raises(ArtifactError, match="schema_version"):
        load_artifact(d)
    cfg["schema_version"] = 1
    cfg["model"]["activation"] = "gelu"
    (d / "config.json").write_text(json.dumps(cfg))
    _refresh_manifest(d)
    with pytest.raises(ArtifactError, match="activation"):
        load_artifact(d)


def test_tasks_travel_with_the_model_and_are_validated(tmp_path):
    spec = MixSpec([0.0, 1.0, 2.0], gamma=0.7)
    d = tmp_path / "m"
    save_artifact(tiny_model(), WordTokenizer(), d, tasks={"pos": spec})
    art = load_artifact(d)
    assert np.allclose(art.tasks["pos"].weights, [0.0, 1.0, 2.0]) and art.tasks["pos"].gamma == 0.7
    (d / "tasks" / "bad.json").write_text(json.dumps({"weights": [1.0]}))
    with pytest.raises(ArtifactError, match=r"bad\.json.*needs 3 weights"):
        load_artifact(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_artifact(tmp_path / "nope")
