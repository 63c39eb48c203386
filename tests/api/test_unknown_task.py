"""One unknown-task error on every surface (#45 item 3): the library, ``embed-file``,
``embed-bulk``'s planning and the API all raise :class:`UnknownTask` (422 ``unknown_task``
over HTTP, listing the names there are), its message written once; and no route maps a
status itself (``api/errors.py``'s table does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from elmo_api.errors import STATUS
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_bulk.plan import BulkOptions, resolve_mix
from elmo_service.embed_file import file_spec
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError, UnknownTask

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emb(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def test_the_library_the_file_cli_and_bulk_raise_the_same_error(emb, tiny_model_dir):
    with pytest.raises(UnknownTask) as lib:
        emb.embed(["a b"], mix="pos")
    assert lib.value.field == "mix" and lib.value.known == ["shipped"]  # the library's argument
    with pytest.raises(UnknownTask) as f:
        file_spec(emb, task="pos")
    with pytest.raises(UnknownTask) as bulk:
        resolve_mix(tiny_model_dir, BulkOptions(output="mix", task="pos"))
    for e in (lib.value, f.value, bulk.value):
        assert isinstance(e, InputError) and e.code == "unknown_task"
        assert e.message == "model has no task 'pos' (known: shipped)"


def test_the_api_answers_it_listing_stored_and_shipped_tasks(tiny_model_dir, tmp_path):
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path, admin_keys=["adm"])
    with TestClient(create_app(s)) as c:
        put = c.put(
            "/v1/tasks/mine", json={"weights": [0, 1, 0]}, headers={"Authorization": "Bearer adm"}
        )
        assert put.status_code == 201, put.text
        r = c.post("/v1/embed", json={"sentences": ["a b"], "task": "pos"})
        assert r.status_code == 422, r.text
        assert r.json() == {
            "code": "unknown_task",
            "message": "model has no task 'pos' (known: mine, shipped)",
            "field": "task",
        }
        r = c.post("/v1/embed", json={"sentences": ["a b"], "task": "mine"})
        assert r.status_code == 200 and r.json()["task"] == "mine", r.text


def test_the_message_is_written_once_and_routes_map_no_status():
    sources = [
        p for top in ("elmo_service", "api", "jobs", "pretrain") for p in (ROOT / top).rglob("*.py")
    ]
    written = [p for p in sources if re.search(r"no task \{", p.read_text())]
    assert written == [ROOT / "elmo_service" / "errors.py"], written
    mapped = {cls.__name__ for cls, _ in STATUS}
    for p in (ROOT / "api" / "routers").glob("*.py"):
        caught = set(re.findall(r"except \(?(\w+)", p.read_text()))
        assert not caught & mapped, f"{p.name} maps {caught & mapped} itself"
