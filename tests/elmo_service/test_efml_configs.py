"""``convert --manylangs DIR`` on a folder as ELMoForManyLangs publishes it (#57): its
``config.json`` names ``cnn_50_100_512_4096_sample.json`` by a path that is not there, a
file of the ``elmoformanylangs`` package, not of the folder. The converter reads it from an installed
``elmoformanylangs``, else from the copies this project ships (``elmo_service/efml-configs``,
MIT, verbatim)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest

from elmo_service import convert_efml as efml
from elmo_service.convert_efml import SAMPLE_CONFIGS, convert_efml, find_network_config
from elmo_service.embedder import Embedder
from elmo_service.errors import ConfigError
from tests.support.efml_fixtures import SENTENCES, write_efml_model

pytestmark = pytest.mark.slow  # writes its model folders with ELMoForManyLangs' own classes

SAMPLES = ("cnn_0_100_512_4096_sample.json", "cnn_50_100_512_4096_sample.json")
# a published config.json names the sample config by a path of its authors' layout
PUBLISHED = "../configs/cnn_50_100_512_4096_sample.json"


def _installed(monkeypatch, root: Path | None) -> None:
    """``elmoformanylangs`` installed at ``root`` (None: not installed), as the finder sees it."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name != "elmoformanylangs":
            return real(name, *args, **kwargs)
        if root is None:
            return None
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(root)]
        return spec

    monkeypatch.setattr(efml.importlib.util, "find_spec", find_spec)


def _as_published(model: Path, dest: Path) -> tuple[Path, dict]:
    """``model`` laid out as a downloaded model: no network config beside it, config.json
    naming the package's sample config by its relative name. Returns the folder and the
    network config its files were written for."""
    shutil.copytree(model, dest)
    net = json.loads((dest / "cnn_net.json").read_text(encoding="utf-8"))
    (dest / "cnn_net.json").unlink()
    (dest / "config.json").write_text(
        json.dumps({"config_path": PUBLISHED, "char_cutoff": 0, "word_cutoff": 0}),
        encoding="utf-8",
    )
    return dest, net


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_efml_model(tmp_path_factory.mktemp("efml") / "model", word_dim=6)


def test_a_published_folder_converts_with_the_installed_package_s_config(
    model, tmp_path, monkeypatch
):
    folder, net = _as_published(model, tmp_path / "zhs.model")
    package = tmp_path / "site" / "elmoformanylangs"
    (package / "configs").mkdir(parents=True)
    (package / "configs" / Path(PUBLISHED).name).write_text(json.dumps(net), encoding="utf-8")
    _installed(monkeypatch, package)
    assert find_network_config(folder, PUBLISHED) == package / "configs" / Path(PUBLISHED).name
    convert_efml(folder, tmp_path / "out")
    convert_efml(model, tmp_path / "ref")  # its config beside it
    got = Embedder.load(tmp_path / "out", threads=1).embed(SENTENCES)
    want = Embedder.load(tmp_path / "ref", threads=1).embed(SENTENCES)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.layers, w.layers)


def test_without_the_package_the_shipped_sample_configs_are_read(model, tmp_path, monkeypatch):
    _installed(monkeypatch, None)
    folder, _ = _as_published(model, tmp_path / "m")
    for name in SAMPLES:
        assert find_network_config(folder, f"../configs/{name}") == SAMPLE_CONFIGS / name
        assert find_network_config(folder, f"/home/someone/configs/{name}") == (
            SAMPLE_CONFIGS / name
        )
    # the folder's own file comes first, as its loader takes it
    (folder / SAMPLES[1]).write_text("{}", encoding="utf-8")
    assert find_network_config(folder, PUBLISHED) == folder / SAMPLES[1]
    (folder / "config.json").write_text(json.dumps({"config_path": "mine.json"}))
    with pytest.raises(ConfigError) as e:  # found nowhere: named, and where it was looked for
        convert_efml(folder, tmp_path / "out")
    assert e.value.field == "config_path" and "mine.json" in e.value.message


def test_the_shipped_configs_are_the_package_s_own_with_its_licence():
    """Verbatim copies of the installed ``elmoformanylangs``' files (the tests install it:
    tests/install_parity_deps.sh), under its MIT licence, and the network they describe."""
    import elmoformanylangs

    package = Path(elmoformanylangs.__file__).parent / "configs"
    for name in SAMPLES:
        assert (SAMPLE_CONFIGS / name).read_bytes() == (package / name).read_bytes()
        net = json.loads((SAMPLE_CONFIGS / name).read_text(encoding="utf-8"))
        cfg = efml.config_from_network(net, char_rows=100, word_rows=100)
        assert (cfg.lstm_dim, cfg.projection_dim, cfg.n_layers) == (4096, 512, 2)
    licence = (SAMPLE_CONFIGS / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("MIT License") and "Permission is hereby granted" in licence
    assert "HIT-SCIR/ELMoForManyLangs" in (SAMPLE_CONFIGS / "README.md").read_text()
