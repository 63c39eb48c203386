"""Hostile ELMoForManyLangs folders (#56 item 4): each made from a valid model written with
the package's own classes (``tests/support/efml_fixtures.py``) by one edit, each refused
by ``convert --manylangs`` in one line naming the file and the field, before anything is
allocated or built, and no artifact written. A hang is caught by the per-test timeout
(pytest-timeout); the tests assert the refusal, never a time."""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from elmo_service.bilm.tensor_header import LEGACY_MAGIC
from elmo_service.convert_efml import MAX_JSON_BYTES, MAX_JSON_DEPTH, convert_efml
from elmo_service.errors import ArtifactError, ConfigError
from tests.support.efml_fixtures import write_efml_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # the package's classes; a hang fails


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    return write_efml_model(tmp_path_factory.mktemp("efml") / "model", word_dim=6, seed=3)


def _copy(valid: Path, tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(valid, d)
    return d


def _refused(d: Path, tmp_path: Path, file: str, field: str | None = None, **kw) -> str:
    """Converting ``d`` is refused in one line naming ``file`` (and ``field``); nothing written."""
    out = tmp_path / "out"
    with pytest.raises((ConfigError, ArtifactError)) as e:
        convert_efml(d, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg and file in msg, msg
    if field is not None:
        assert e.value.field == field and field in msg, (e.value.field, msg)
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    return msg


def _net(d: Path, part: str, key: str, value) -> None:
    net = json.loads((d / "cnn_net.json").read_text())
    net[part][key] = value
    (d / "cnn_net.json").write_text(json.dumps(net))


def _state(d: Path, file: str) -> dict:
    return torch.load(d / file, weights_only=True)


# ------------------------------------------------------------------ forged pickles
class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride, n = [], 1
        for size in reversed(self.shape):
            stride.insert(0, n)
            n *= size
        args = (self.storage, 0, self.shape, tuple(stride), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def __init__(self, f, legacy: bool) -> None:
        super().__init__(f, protocol=2)
        self.legacy = legacy

    def persistent_id(self, obj):
        if not isinstance(obj, _Storage):
            return None
        pid = ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return (*pid, None) if self.legacy else pid


def _forge(path: Path, shape: tuple[int, ...], legacy: bool) -> None:
    """A torch.save file of one tensor declaring ``prod(shape)`` float32 values and holding
    16 bytes: what torch.load would allocate in full before noticing."""
    import io

    numel = 1
    for n in shape:
        numel *= n
    state = {"char_emb_layer.embedding.weight": _Tensor(_Storage("0", numel), shape)}
    buf = io.BytesIO()
    _Pickler(buf, legacy).dump(state)
    if legacy:
        with open(path, "wb") as f:
            for value in (LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True}):
                pickle.dump(value, f, protocol=2)
            f.write(buf.getvalue())
            pickle.dump(["0"], f, protocol=2)
            f.write(struct.pack("<q", numel) + b"\0" * 16)
        return
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", b"\0" * 16)
        z.writestr("archive/version", "3\n")


# ------------------------------------------------------------------ the cases
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_tiny_file_declaring_billions_of_values_is_refused_unallocated(valid, tmp_path, legacy):
    d = _copy(valid, tmp_path)
    _forge(d / "token_embedder.pkl", (100_000, 100_000), legacy)  # 40 GB declared, 16 B held
    assert (d / "token_embedder.pkl").stat().st_size < 2048
    msg = _refused(d, tmp_path, "token_embedder.pkl", "token_embedder.pkl")
    assert "declares 10,000,000,000 values" in msg


def test_a_tensor_of_the_wrong_shape(valid, tmp_path):
    d = _copy(valid, tmp_path)
    state = _state(d, "encoder.pkl")
    state["forward_layer_1.state_projection.weight"] = torch.zeros(8, 15)
    torch.save(state, d / "encoder.pkl")
    msg = _refused(d, tmp_path, "encoder.pkl", "forward_layer_1.state_projection.weight")
    assert "shape [8, 15]" in msg and "needs [8, 16]" in msg


def test_a_meta_tensor(valid, tmp_path):
    d = _copy(valid, tmp_path)
    state = _state(d, "token_embedder.pkl")
    state["projection.weight"] = torch.empty(8, 22, device="meta")
    torch.save(state, d / "token_embedder.pkl")
    msg = _refused(d, tmp_path, "token_embedder.pkl", "projection.weight")
    assert "'meta'" in msg


def test_an_integer_tensor(valid, tmp_path):
    d = _copy(valid, tmp_path)
    state = _state(d, "token_embedder.pkl")
    state["projection.bias"] = torch.zeros(8, dtype=torch.int64)
    torch.save(state, d / "token_embedder.pkl")
    assert "not floating point" in _refused(d, tmp_path, "token_embedder.pkl", "projection.bias")


def test_a_tensor_the_config_does_not_describe(valid, tmp_path):
    d = _copy(valid, tmp_path)
    state = _state(d, "encoder.pkl")  # a third layer's tensors: n_layers says 2
    for k in [k for k in state if k.startswith("forward_layer_1.")]:
        state[k.replace("_1.", "_2.")] = state[k].clone()
    torch.save(state, d / "encoder.pkl")
    assert "does not describe" in _refused(d, tmp_path, "encoder.pkl")


@pytest.mark.parametrize(
    ("part", "key", "value", "says"),
    [
        ("encoder", "n_layers", 100_000, "is 100,000; it must be in [1, 16]"),
        ("token_embedder", "n_highway", 1e7, "must be an integer, not 10000000.0"),
        ("token_embedder", "n_highway", 10_000_000, "is 10,000,000"),
        ("token_embedder", "max_characters_per_token", 1e9, "must be an integer"),
        ("token_embedder", "max_characters_per_token", 10**9, "is 1,000,000,000"),
        ("encoder", "dim", 10**12, "must be in [1, 65,536]"),
        ("encoder", "projection_dim", 4096, "needs [4096"),  # within the maxima: the tensors say no
        ("token_embedder", "char_dim", 2**40, "must be in"),
        ("encoder", "projection_dim", -3, "must be in"),
        ("token_embedder", "char_dim", 1.5, "must be"),
    ],
)
def test_huge_sizes_in_the_network_config(valid, tmp_path, part, key, value, says):
    d = _copy(valid, tmp_path)
    _net(d, part, key, value)
    msg = _refused(d, tmp_path, "cnn_net.json" if "needs" not in says else "token_embedder.pkl")
    assert says in msg, msg
    if "needs" not in says:
        assert f"{part}.{key}" in msg


@pytest.mark.parametrize(
    "filters",
    [[[1, 10**9]], [[10**6, 4]], [[1, 4]] * 100_000, [["1", 4]], [[1, 4, 5]]],
    ids=["count", "width", "many", "string", "triple"],
)
def test_huge_or_malformed_filters(valid, tmp_path, filters):
    d = _copy(valid, tmp_path)
    _net(d, "token_embedder", "filters", filters)
    assert "token_embedder.filters" in _refused(d, tmp_path, "cnn_net.json")


@pytest.mark.parametrize("file", ["config.json", "cnn_net.json"])
def test_json_nested_100000_deep(valid, tmp_path, file):
    d = _copy(valid, tmp_path)
    (d / file).write_text("[" * 100_000 + "]" * 100_000)
    assert f"deeper than {MAX_JSON_DEPTH}" in _refused(d, tmp_path, file)


def test_a_3_gb_config_is_refused_unread(valid, tmp_path):
    d = _copy(valid, tmp_path)
    with open(d / "config.json", "r+b") as f:
        f.truncate(3 << 30)  # sparse: no disk used, 3 GB to a reader
    msg = _refused(d, tmp_path, "config.json", "config.json")
    assert f"the limit is {MAX_JSON_BYTES:,}" in msg


@pytest.mark.parametrize(
    ("dic", "edit", "says"),
    [
        ("char.dic", lambda t: t + "ζ\t-1\n", "has id -1"),
        ("char.dic", lambda t: t + "ζ\t3\n", "id 3 is given to both"),
        ("char.dic", lambda t: t + "ζ\t999999\n", "has id 999999"),
        ("word.dic", lambda t: t + "zebra\t13\n", "the embedding has 13 rows"),
        ("word.dic", lambda t: t + "zebra\t0\n", "id 0 is given to both"),
    ],
    ids=["negative", "duplicate", "past-the-rows", "word-past-the-rows", "word-duplicate"],
)
def test_dictionary_ids_out_of_range_or_repeated(valid, tmp_path, dic, edit, says):
    d = _copy(valid, tmp_path)
    (d / dic).write_text(edit((d / dic).read_text(encoding="utf-8")), encoding="utf-8")
    assert says in _refused(d, tmp_path, dic, dic)


def test_a_config_path_outside_the_folder_is_read_only_when_passed(valid, tmp_path):
    d = _copy(valid, tmp_path)
    outside = tmp_path / "elsewhere" / "net.json"
    outside.parent.mkdir()
    shutil.move(d / "cnn_net.json", outside)
    (d / "config.json").write_text(json.dumps({"config_path": "../elsewhere/net.json"}))
    msg = _refused(d, tmp_path, "config.json", "config_path")
    assert "passed explicitly" in msg
    # a symlink inside the folder that leads out of it is the same path
    (d / "net.json").symlink_to(outside)
    _refused(d, tmp_path, "config.json", "config_path")
    # given by the user, it is read
    convert_efml(d, tmp_path / "ok", network_config=outside)
    assert (tmp_path / "ok" / "selftest.json").is_file()


def test_a_code_payload_never_runs_and_torch_advice_is_not_passed_on(valid, tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = _copy(valid, tmp_path)
    state = _state(d, "encoder.pkl")
    state["evil"] = Payload()
    torch.save(state, d / "encoder.pkl")
    msg = _refused(d, tmp_path, "encoder.pkl", "encoder.pkl")
    assert "holds code" in msg and "weights_only=False" not in msg
    assert not marker.exists()


def test_a_model_that_cannot_embed_fails_its_self_test_and_is_not_written(valid, tmp_path):
    d = _copy(valid, tmp_path)
    state = _state(d, "token_embedder.pkl")
    state["projection.weight"] = torch.full((8, 22), 3e38)  # finite weights, infinite vectors
    torch.save(state, d / "token_embedder.pkl")
    assert "self-test" in _refused(d, tmp_path, "ELMoForManyLangs", "selftest")


def test_the_cli_refuses_in_one_line(valid, tmp_path, capsys):
    from elmo_cli.core import main

    d = _copy(valid, tmp_path)
    _net(d, "encoder", "n_layers", 100_000)
    assert main(["convert", "--manylangs", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cnn_net.json" in err and "encoder.n_layers" in err
    assert not (tmp_path / "out").exists()


def test_the_valid_model_still_converts(valid, tmp_path):
    convert_efml(valid, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "selftest.json").read_text())
    assert len(meta["tokens"]) == 8  # its own self-test is stored with it


def test_the_legacy_format_of_published_models_converts_to_the_same_weights(valid, tmp_path):
    """Published models were saved by torch < 1.6 (the legacy stream, not a zip archive):
    their headers are read too, and they convert to the same weights."""
    from safetensors.torch import load_file

    d = _copy(valid, tmp_path)
    for f in ("token_embedder.pkl", "encoder.pkl"):
        torch.save(_state(d, f), d / f, _use_new_zipfile_serialization=False)
        assert not zipfile.is_zipfile(d / f)
    convert_efml(valid, tmp_path / "zip")
    convert_efml(d, tmp_path / "legacy")
    a = load_file(str(tmp_path / "zip" / "weights.safetensors"))
    b = load_file(str(tmp_path / "legacy" / "weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_as_published_finds_its_config_in_the_installed_package(tmp_path):
    """Published folders' config.json names a file on their authors' machine that they do not
    ship: the converter reads it from an installed elmoformanylangs' configs/ (#57 item 8)."""
    from elmo_service.convert_efml import read_network_config

    name = "cnn_50_100_512_4096_sample.json"
    (tmp_path / "config.json").write_text(json.dumps({"config_path": f"/home/a/configs/{name}"}))
    net, found = read_network_config(tmp_path)
    assert found.name == name and found.parent.name == "configs"
    assert net["encoder"]["projection_dim"] == 512 and net["encoder"]["dim"] == 4096
