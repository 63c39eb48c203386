"""``Embedder.load`` from any folder (#51): no path is the served default (the bundled model),
and a repository-relative path tried elsewhere names the folder that exists."""

from __future__ import annotations

import pytest

from elmo_service import Embedder
from elmo_service.artifact import BUNDLED_MODELS_DIR
from elmo_service.errors import ArtifactError


def test_no_path_loads_the_bundled_model_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("ELMO_MODEL_PATH", "ELMO_MODELS_DIR", "ELMO_MODEL"):
        monkeypatch.delenv(var, raising=False)
    emb = Embedder.load()
    assert emb.version == Embedder.load(BUNDLED_MODELS_DIR / "default").version


def test_a_relative_path_from_elsewhere_names_the_one_that_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError) as e:
        Embedder.load("models/default")
    assert str(BUNDLED_MODELS_DIR / "default") in str(e.value)
    assert "\n" not in str(e.value)
