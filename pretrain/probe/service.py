"""Where a learned task goes: the artifact's ``tasks/`` and/or a running service.

The service is reached with the project's client (``elmo_client.Client``, the
``elmo-service-client`` distribution: ``pip install ./clients/python``). If the
PUT fails, the learned mix is not lost: it is written to a fallback file and the error
says where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elmo_service.artifact import TASKS, write_task
from elmo_service.atomic import write_json
from elmo_service.errors import InputError
from elmo_service.scalar_mix import MixSpec

try:  # the client is its own distribution (the `client` extra)
    from elmo_client import Client, ServiceError, ServiceUnreachable
except ImportError:  # --service then says how to install it (_client)
    Client = None  # type: ignore[assignment,misc]

    class ServiceError(Exception):  # type: ignore[no-redef]  # never raised without a client
        pass

    ServiceUnreachable = ServiceError  # type: ignore[assignment,misc]

# a store or a check, not a bulk job: a refusal is reported, not waited out
_RETRIES = dict(retries=2, retry_deadline=10.0)


def _client(service: str, admin_key: str | None, timeout: float = 10) -> Client:
    if Client is None:
        raise InputError(
            "--service needs the client: pip install ./clients/python (elmo-service-client)",
            field="service",
        )
    try:
        return Client(service, admin_key, timeout=timeout, **_RETRIES)
    except InputError as e:  # not a URL the client can use
        raise InputError(f"{service}: {e.message}", field="service") from None


def _service_error(service: str, e: Exception) -> str:
    if isinstance(e, ServiceError):
        return f"{service} answered {e.status}: {e.message}"
    if isinstance(e, ServiceUnreachable):
        return f"{service} is not reachable: {e.reason}"
    return str(e)


def check_service(
    service: str,
    admin_key: str | None,
    model_version: str | None = None,
    n_layers: int | None = None,
    task_name: str | None = None,
    overwrite: bool = False,
) -> None:
    """Before any work: the service answers and knows the key, serves the model the task
    will be learned on (``model_version``, ``n_layers``), and ships no task ``task_name``
    unless ``overwrite``. InputError naming --service (or --task-name) otherwise."""
    with _client(service, admin_key) as client:
        try:
            tasks = client.tasks.list()
            models = client.models.list() if model_version else None
        except (ServiceError, ServiceUnreachable) as e:
            raise InputError(_service_error(service, e), field="service") from None
    if model_version is not None:
        served = (models or {}).get("served") or {}
        if served.get("version") != model_version:
            layers = (models or {}).get("data", [{}])[0].get("n_layers")
            extra = (
                f" ({layers} output layers there, {n_layers} here)"
                if n_layers is not None and layers is not None and layers != n_layers
                else ""
            )
            raise InputError(
                f"{service} serves model version {served.get('version')!r} "
                f"({served.get('id', '?')}), not {model_version!r}, the one the task would be "
                f"learned on{extra}: pass that model with --model, or serve this one",
                field="service",
            )
    if task_name is not None and not overwrite:
        shipped = {t.get("name") for t in tasks if t.get("source") == "model"}
        if task_name in shipped:
            raise InputError(
                f"{service}'s model ships a task named {task_name!r}: choose another "
                "--task-name, or add --overwrite to register an override",
                field="task_name",
            )


def check_destinations(
    o: Any, model_dir: Path, name: str, *, model_version: str, n_layers: int
) -> None:
    """Before any data is read: ``--store`` may write ``name`` into the model, and the
    ``--service`` serves the model the mix is learned on (``o``: the command's options)."""
    if o.store:
        check_store(model_dir, name, o.overwrite)
    if o.service:
        check_service(
            o.service,
            o.admin_key,
            model_version=model_version,
            n_layers=n_layers,
            task_name=name,
            overwrite=o.overwrite,
        )


def check_store(model_dir: Path, name: str, overwrite: bool) -> None:
    """Before any work: --store must not replace a task the model ships unless asked."""
    path = model_dir / TASKS / f"{name}.json"
    if path.exists() and not overwrite:
        raise InputError(
            f"{path} exists: the model ships a task named {name!r}; choose another "
            "--task-name, or add --overwrite to replace it",
            field="task_name",
        )


def save_task(
    spec: MixSpec,
    name: str,
    model_dir: Path | None = None,
    service: str | None = None,
    admin_key: str | None = None,
    fallback: Path | None = None,
) -> list[str]:
    """Store the mix with the artifact and/or PUT it to a running service."""
    done = []
    if model_dir is not None:
        done.append(str(write_task(model_dir, name, spec)))
    if service:
        url = f"{service.rstrip('/')}/v1/tasks/{name}"
        try:
            with _client(service, admin_key, timeout=30) as client:
                client.tasks.put(name, spec)
        except (ServiceError, ServiceUnreachable, InputError) as e:
            msg = _service_error(service, e)
            if fallback is not None:
                fallback.parent.mkdir(parents=True, exist_ok=True)
                write_json(fallback, spec.to_dict(), sort_keys=True)
                msg += f"; the learned task is saved in {fallback} (PUT it to {url} later)"
            raise InputError(msg, field="service") from None
        done.append(url)
    return done


def write_and_store(spec: MixSpec, name: str, out: Path, model_dir: Path, o: Any) -> None:
    """The run folder's ``task.json``, then ``--store`` / ``--service`` (``o``: the command's
    options; a service that cannot be reached leaves the task.json to register later)."""
    write_json(out / "task.json", spec.to_dict(), sort_keys=True)
    print(f"task: {out / 'task.json'}")
    stored = save_task(
        spec,
        name,
        model_dir=model_dir if o.store else None,
        service=o.service,
        admin_key=o.admin_key,
        fallback=out / "task.json",
    )
    for where in stored:
        print(f"task stored: {where}")
