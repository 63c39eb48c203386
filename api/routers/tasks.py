"""Tasks: named scalar-mix weights + gamma, validated against the model's layers.

Stored in Redis when ``REDIS_URL`` is set, else in a local JSON file
(``ELMO_TASKS_FILE``, default ``<ELMO_DATA_DIR>/tasks.json``). Tasks shipped in
the model artifact are listed with ``source: "model"`` and are read-only; a PUT
of the same name stores an override. Writes need an admin key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Path
from starlette.responses import Response

from elmo_api.deps import ModelDep, require_admin, require_key
from elmo_api.encoding import JSONBytesResponse
from elmo_api.errors import ApiError
from elmo_api.schemas import ERROR_RESPONSES, TaskDeleted, TaskIn, TaskList, TaskOut
from elmo_api.served import ServedModel
from elmo_api.tasks_store import json_problem
from elmo_service.scalar_mix import MixSpec, check_task_name

router = APIRouter(prefix="/v1", tags=["tasks"], dependencies=[Depends(require_key)])

T = TypeVar("T")
NamePath = Path(..., description="Task name: letters, digits, '_', '.', '-'", examples=["ner"])


async def _io(served: ServedModel, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` off the event loop (the store may block; its outage is a 503 by
    ``api/errors.py``'s table)."""
    return await asyncio.get_running_loop().run_in_executor(served.io, fn, *args)


@router.get("/tasks", response_model=TaskList, responses=ERROR_RESPONSES, summary="List tasks")
async def list_tasks(served: ModelDep) -> dict[str, Any]:
    data, unreadable = await _io(served, served.tasks.listing)
    return {"object": "list", "n_layers": served.n_layers, "data": data, "unreadable": unreadable}


@router.get(
    "/tasks/{name}", response_model=TaskOut, responses=ERROR_RESPONSES, summary="Get a task"
)
async def get_task(served: ModelDep, name: str = NamePath) -> dict[str, Any]:
    found = await _io(served, served.tasks.spec, name)
    if found is None:
        raise ApiError(404, "not_found", f"no task named {name!r}", "name")
    spec, source = found
    return served.tasks.describe(name, spec, source)


@router.put(
    "/tasks/{name}",
    response_model=TaskOut,
    responses={**ERROR_RESPONSES, 201: {"model": TaskOut, "description": "Created"}},
    summary="Create or replace a task (admin)",
    dependencies=[Depends(require_admin)],
)
async def put_task(body: TaskIn, served: ModelDep, name: str = NamePath) -> Response:
    check_task_name(name)
    problem = json_problem(body.meta, "meta")
    if problem is not None:  # stored, it would break every later read of the tasks (#50)
        where, why = problem
        raise ApiError(422, "invalid_input", f"{where}: {why}; it cannot be stored", where)
    spec = MixSpec(
        weights=list(body.weights),
        gamma=body.gamma,
        per_direction=body.per_direction,
        layer_norm=body.layer_norm,
        meta=dict(body.meta),
    )
    spec.validate(served.n_layers, "weights", gamma_field="gamma")
    created = await _io(served, served.tasks.put, name, spec)
    return JSONBytesResponse(
        served.tasks.describe(name, spec, "store"), status_code=201 if created else 200
    )


@router.delete(
    "/tasks/{name}",
    response_model=TaskDeleted,
    responses=ERROR_RESPONSES,
    summary="Delete a stored task (admin); shipped tasks are read-only",
    dependencies=[Depends(require_admin)],
)
async def delete_task(served: ModelDep, name: str = NamePath) -> dict[str, Any]:
    result = await _io(served, served.tasks.delete, name)
    if result == "read_only":
        raise ApiError(
            409,
            "read_only",
            f"task {name!r} is shipped with the model and cannot be deleted",
            "name",
        )
    if result == "missing":
        raise ApiError(404, "not_found", f"no task named {name!r}", "name")
    return {"deleted": name, "model_task_visible": name in served.tasks.shipped}
