"""``convert --manylangs`` on hostile folders (#56 finding 4): each case is made from a valid
ELMoForManyLangs model written with that package's own classes, and each is refused in one
line naming the file and the field, quickly (pytest-timeout catches a hang), before anything
is built or written -- never a traceback, a hang, a giant allocation or an accepted model
that fails later."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from elmo_service.convert_efml import convert_efml
from elmo_service.errors import ArtifactError, ConfigError
from tests.support.efml_fixtures import write_efml_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_efml_model(tmp_path_factory.mktemp("efml") / "m", word_dim=0, seed=1)


def _refused(tmp_path: Path, src: Path, edit) -> ConfigError | ArtifactError:
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    edit(d)
    with pytest.raises((ConfigError, ArtifactError)) as e:
        convert_efml(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 500, msg  # one line
    assert "weights_only=False" not in msg
    return e.value


def _net(**changes):
    def edit(d: Path) -> None:
        net = json.loads((d / "cnn_net.json").read_text())
        for path, value in changes.items():
            part, key = path.split("__")
            net[part][key] = value
        (d / "cnn_net.json").write_text(json.dumps(net))

    return edit


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"encoder__n_layers": 100000}, "encoder.n_layers"),
        ({"token_embedder__n_highway": 10**7}, "token_embedder.n_highway"),
        ({"token_embedder__max_characters_per_token": 10**9}, "max_characters_per_token"),
        ({"encoder__dim": 10**9}, "encoder.dim"),
        ({"encoder__projection_dim": -3}, "encoder.projection_dim"),
        ({"token_embedder__char_dim": 1.5}, "token_embedder.char_dim"),
        ({"token_embedder__filters": [[1, 10**9]]}, "token_embedder.filters[0][1]"),
        ({"token_embedder__filters": [[1, 4]] * 1000}, "token_embedder.filters"),
    ],
)
def test_sizes_beyond_any_model_are_refused_before_building(tmp_path, src, changes, field):
    e = _refused(tmp_path, src, _net(**changes))
    assert field in (e.field or ""), e


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path, src):
    def edit(d: Path) -> None:
        sd = torch.load(d / "encoder.pkl", weights_only=True)
        k = "forward_layer_0.state_projection.weight"
        sd[k] = sd[k][:, :-1].clone()
        torch.save(sd, d / "encoder.pkl")

    e = _refused(tmp_path, src, edit)
    assert "w_proj" in (e.field or "") and "does not fit" in str(e)


def test_a_tensor_declaring_more_values_than_its_file_holds(tmp_path, src):
    """A small file whose tensor claims billions of values: refused without allocating."""

    def edit(d: Path) -> None:
        sd = torch.load(d / "encoder.pkl", weights_only=True)
        k = "forward_layer_0.state_projection.weight"
        sd[k] = torch.zeros(4)
        torch.save(sd, d / "encoder.pkl")
        # rewrite the pickled shape: (4,) -> (50000, 50000) = 2.5e9 floats, 10 GB
        path = d / "encoder.pkl"
        with zipfile.ZipFile(path) as z:
            items = {n: z.read(n) for n in z.namelist()}
        pkl = next(n for n in items if n.endswith("data.pkl"))
        data = items[pkl]
        # the tensor's size tuple (4,) pickles as K\x04\x85 (BININT1 4, TUPLE1); make it
        # (50000, 50000): M P\xc3 (BININT2 50000) twice, TUPLE2
        new = data.replace(b"K\x04\x85", b"MP\xc3MP\xc3\x86", 1)
        assert new != data
        items[pkl] = new
        with zipfile.ZipFile(path, "w") as z:
            for n, b in items.items():
                z.writestr(n, b)

    e = _refused(tmp_path, src, edit)
    assert e.field in ("encoder.pkl", "forward_layer_0.state_projection.weight"), e


def test_a_meta_tensor_is_refused(tmp_path, src):
    def edit(d: Path) -> None:
        sd = torch.load(d / "encoder.pkl", weights_only=True)
        sd["forward_layer_0.state_projection.weight"] = torch.empty(8, 16, device="meta")
        torch.save(sd, d / "encoder.pkl")

    e = _refused(tmp_path, src, edit)
    assert "meta" in str(e) or e.field == "encoder.pkl", e


def test_json_too_deep_or_too_big(tmp_path, src):
    deep = _refused(
        tmp_path / "a",
        src,
        lambda d: (d / "cnn_net.json").write_text("[" * 100_000 + "]" * 100_000),
    )
    assert deep.field == "config_path" and "nested" in str(deep)
    big = _refused(
        tmp_path / "b",
        src,
        lambda d: (d / "cnn_net.json").write_text('{"x": "' + "a" * (2 << 20) + '"}'),
    )
    assert big.field == "config_path" and "bytes" in str(big)


def test_a_config_path_outside_the_folder_is_not_read(tmp_path, src):
    outside = tmp_path / "elsewhere.json"
    outside.write_text((src / "cnn_net.json").read_text())

    def edit(d: Path) -> None:
        (d / "cnn_net.json").unlink()
        (d / "config.json").write_text(json.dumps({"config_path": "../elsewhere.json"}))

    e = _refused(tmp_path, src, edit)
    assert e.field == "config_path" and "outside the folder is not read" in str(e)


@pytest.mark.parametrize("bad", ["negative", "duplicate"])
def test_dictionary_ids_in_range_and_unique(tmp_path, src, bad):
    def edit(d: Path) -> None:
        lines = (d / "char.dic").read_text(encoding="utf-8").splitlines()
        key, _ = lines[-1].split("\t") if "\t" in lines[-1] else ("x", "0")
        lines[-1] = f"{key}\t{-5 if bad == 'negative' else 0}"
        (d / "char.dic").write_text("\n".join(lines) + "\n", encoding="utf-8")

    e = _refused(tmp_path, src, edit)
    assert e.field == "char.dic", e


def test_a_folder_as_published_finds_its_config_in_the_installed_package(tmp_path):
    """Published folders' config.json names a file on their authors' machine that they do not
    ship: the converter reads it from an installed elmoformanylangs' configs/ (#57 item 8)."""
    from elmo_service.convert_efml import read_network_config

    name = "cnn_50_100_512_4096_sample.json"
    (tmp_path / "config.json").write_text(json.dumps({"config_path": f"/home/a/configs/{name}"}))
    net, found = read_network_config(tmp_path)
    assert found == name
    assert net["encoder"]["projection_dim"] == 512 and net["encoder"]["dim"] == 4096
