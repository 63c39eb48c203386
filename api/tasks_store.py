"""Named scalar-mix tasks: stored in Redis when configured, else a local JSON file.

Tasks shipped inside the model artifact (its ``tasks/`` folder) are visible
read-only; a PUT of the same name stores an override, and deleting that
override brings the shipped task back. The folder is re-read when it changes
(:class:`ArtifactTasks`), so a task written there by ``elmo-pretrain probe
--store`` is served without a restart. Stored tasks are namespaced by the
served model's name and validated against its layer count when written and
when used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elmo_service.artifact import TASKS, read_manifest, read_task
from elmo_service.atomic import write_json
from elmo_service.errors import ConfigError, ElmoServiceError
from elmo_service.scalar_mix import MixSpec
from elmo_storage import StoreUnavailable, connect, expect, file_lock, unavailable

log = logging.getLogger("api")

JSON_DEPTH = 64  # orjson (the API's encoder) refuses past 254 levels; notes need far fewer


class TaskUnreadable(ElmoServiceError):
    """A stored task that cannot be answered (written by hand or by an older server, with a
    value the API's JSON cannot carry): its GET answers 409 naming it, the list flags it."""

    code = "unreadable_task"


def json_problem(value: Any, where: str, depth: int = 0) -> tuple[str, str] | None:
    """(the path, what is wrong) where ``value`` stops being JSON that the API's encoder
    (orjson) writes and reads back the same; None when all of it does. Catches what
    Python's ``json`` takes and orjson does not: integers past 64 bits, NaN/inf, lone
    surrogates, non-string keys, nesting past JSON_DEPTH."""
    if depth > JSON_DEPTH:
        return where, f"nested deeper than {JSON_DEPTH} levels"
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return None
        return where, f"an integer of {value.bit_length()} bits (JSON numbers here: 64 bits)"
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, f"{value} is not a finite number")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where, "not valid Unicode (lone surrogate)"
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := json_problem(v, f"{where}[{i}]", depth + 1)) is not None:
                return found
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return where, f"key {k!r} is not a string"
            if (found := json_problem(v, f"{where}.{k}", depth + 1)) is not None:
                return found
        return None
    return where, f"a {type(value).__name__}, not a JSON value"


def _is_hash(reply: object) -> bool:
    return isinstance(reply, dict) and all(
        isinstance(k, bytes) and isinstance(v, bytes) for k, v in reply.items()
    )


def _is_string(reply: object) -> bool:
    return reply is None or isinstance(reply, bytes)


def _is_count(reply: object) -> bool:  # HSET and HDEL answer how many fields changed
    return isinstance(reply, int) and not isinstance(reply, bool) and 0 <= reply <= 1


class Unparsed(str):
    """A stored entry that is not JSON at all (a corrupt write, or a store answering
    nonsense): flagged by the list; a shipped task of that name stays served."""


def _parsed(v: bytes) -> Any:
    """A stored entry decoded; what does not parse is kept as :class:`Unparsed` text."""
    try:
        return json.loads(v)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, an int past 4300 digits
        return Unparsed(v.decode(errors="replace"))


class TaskStore(ABC):
    kind: str

    @abstractmethod
    def all(self) -> dict[str, dict[str, Any]]: ...

    @abstractmethod
    def get(self, name: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def put(self, name: str, spec: dict[str, Any]) -> None: ...

    @abstractmethod
    def delete(self, name: str) -> bool: ...


class FileTaskStore(TaskStore):
    """``{namespace: {name: spec}}`` in one JSON file, rewritten atomically.

    Safe for several processes on one file (replicas sharing a volume without Redis):
    every read-modify-write holds an ``flock`` on ``<file>.lock`` and re-reads the file
    under it; readers need no lock, the file is replaced whole.
    """

    kind = "file"

    def __init__(self, path: Path, namespace: str) -> None:
        self.path = Path(path)
        self.namespace = namespace
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreUnavailable(f"task file {self.path} is unreadable: {e}") from e
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, data, sort_keys=True)

    def all(self) -> dict[str, dict[str, Any]]:
        return dict(self._read().get(self.namespace, {}))

    def get(self, name: str) -> dict[str, Any] | None:
        return self.all().get(name)

    def put(self, name: str, spec: dict[str, Any]) -> None:
        with file_lock(self._lock_path):
            data = self._read()
            data.setdefault(self.namespace, {})[name] = spec
            self._write(data)

    def delete(self, name: str) -> bool:
        with file_lock(self._lock_path):
            data = self._read()
            found = data.get(self.namespace, {}).pop(name, None) is not None
            if found:
                self._write(data)
            return found


class RedisTaskStore(TaskStore):
    """One hash per model: ``<prefix>:tasks:<namespace>`` name -> JSON. No TTL: tasks persist."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        prefix: str = "elmo",
        password: Any = None,
        timeout: float = 0.5,
        client: Any = None,
    ):
        self.key = f"{prefix}:tasks:{namespace}"
        self.client = client or connect(url, password=password, timeout=timeout)

    def _call(self, fn, *args, ok: Callable[[Any], bool], what: str):
        """``fn(*args)``; an error, or a reply ``ok`` refuses, is StoreUnavailable."""
        with unavailable("task store"):
            reply = fn(*args)
            expect(ok(reply), what, reply)
            return reply

    def all(self) -> dict[str, dict[str, Any]]:
        raw = self._call(self.client.hgetall, self.key, ok=_is_hash, what="HGETALL")
        # a corrupt entry comes back as it is: the registry flags it (TaskUnreadable)
        return {k.decode(errors="replace"): _parsed(v) for k, v in raw.items()}

    def get(self, name: str) -> dict[str, Any] | None:
        v = self._call(self.client.hget, self.key, name, ok=_is_string, what="HGET")
        return None if v is None else _parsed(v)

    def put(self, name: str, spec: dict[str, Any]) -> None:
        self._call(self.client.hset, self.key, name, json.dumps(spec, sort_keys=True),
                   ok=_is_count, what="HSET")  # fmt: skip

    def delete(self, name: str) -> bool:
        return bool(self._call(self.client.hdel, self.key, name, ok=_is_count, what="HDEL"))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class ArtifactTasks:
    """The tasks in an artifact's ``tasks/`` folder, re-read when the folder changes.

    Each look-up stats the folder and its ``*.json`` files (a few syscalls; tasks
    are few) and re-reads only when a name, size or mtime differs from the last
    read. A file that does not parse or does not fit the model is skipped with a
    warning (once per change), keeping the others served.

    Pinned to the loaded ``version``: the folder is re-read only while its manifest
    still names that version. Once the folder is replaced by another artifact (an
    ``export --overwrite``) or deleted, the tasks read last stay served: they belong
    to the weights in memory; the new folder's tasks come with its activation.
    """

    def __init__(
        self,
        artifact_dir: Path,
        n_layers: int,
        initial: dict[str, MixSpec],
        version: str | None = None,
    ) -> None:
        self.folder = Path(artifact_dir) / TASKS
        self.n_layers = n_layers
        self.version = version
        self._lock = threading.Lock()
        self._tasks = dict(initial)
        self._signature = self._stat()
        self.reloads = 0
        self.pinned: str | None = None  # why the folder is no longer read, once it is not

    def _stat(self) -> tuple:
        try:
            with os.scandir(self.folder) as it:
                entries = [e for e in it if e.name.endswith(".json") and e.is_file()]
                return tuple(
                    sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries)
                )
        except FileNotFoundError:
            return ()

    def _folder_version(self) -> str | None:
        try:
            return read_manifest(self.folder.parent).get("version")
        except (ElmoServiceError, OSError):
            return None

    def _still_ours(self) -> bool:
        if self.version is None:
            return True
        have = self._folder_version()
        if have == self.version:
            self.pinned = None
            return True
        why = (
            f"{self.folder.parent} now holds version {have}"
            if have is not None
            else f"{self.folder.parent} is gone or unreadable"
        )
        if why != self.pinned:
            log.warning(
                "%s, not the served %s: its shipped tasks stay as loaded", why, self.version
            )
        self.pinned = why
        return False

    def current(self) -> dict[str, MixSpec]:
        sig = self._stat()
        if sig == self._signature:
            return self._tasks
        with self._lock:
            if sig != self._signature:
                if not self._still_ours():
                    self._signature = sig  # looked at again when the folder changes again
                    return self._tasks
                tasks = {}
                for name, _, _ in sig:
                    path = self.folder / name
                    try:
                        tasks[path.stem] = read_task(path, self.n_layers)
                    except (ElmoServiceError, OSError) as e:
                        log.warning("task file %s skipped: %s", path, getattr(e, "message", e))
                if not self._still_ours():  # replaced while being read: keep the old ones
                    self._signature = sig
                    return self._tasks
                self._tasks, self._signature = tasks, sig
                self.reloads += 1
                log.info("tasks folder %s re-read: %s", self.folder, ", ".join(tasks) or "none")
        return self._tasks


class TaskRegistry:
    """Shipped tasks + a store; the store wins. Remembers the last good read
    so that embedding with a task survives a store outage."""

    def __init__(
        self, store: TaskStore, shipped: dict[str, MixSpec] | ArtifactTasks, n_layers: int
    ) -> None:
        self.store = store
        self._shipped = shipped
        self.n_layers = n_layers
        self.generation = 0  # bumped by every write through this registry
        self._last: dict[str, dict[str, Any]] = {}
        self._shipped_seen: dict[str, MixSpec] | None = None

    @property
    def shipped(self) -> dict[str, MixSpec]:
        """The artifact's tasks as of now (a changed folder also bumps ``generation``)."""
        if isinstance(self._shipped, dict):
            return self._shipped
        now = self._shipped.current()
        if now is not self._shipped_seen:
            if self._shipped_seen is not None:
                self.generation += 1  # e.g. a new "default" task: forget memoised mixes
            self._shipped_seen = now
        return now

    def _stored(self) -> dict[str, dict[str, Any]]:
        try:
            data = self.store.all()
        except StoreUnavailable:
            if self._last:
                return dict(self._last)
            raise
        self._last = dict(data)
        return data

    def describe(self, name: str, spec: MixSpec, source: str) -> dict[str, Any]:
        d = spec.to_dict()
        d.update(
            name=name, source=source, overrides_model=source == "store" and name in self.shipped
        )
        d["read_only"] = source == "model"
        return d

    def readable(self, name: str, raw: Any) -> MixSpec:
        """A stored entry as a MixSpec whose description the API can answer; TaskUnreadable
        naming it otherwise (never a 500 for every caller: #50 item 6)."""
        try:
            spec = MixSpec.from_dict(raw)
            problem = json_problem(spec.to_dict(), "task")
            why = None if problem is None else f"{problem[0]}: {problem[1]}"
        except (ConfigError, TypeError, ValueError, KeyError, AttributeError) as e:
            why = getattr(e, "message", None) or str(e) or type(e).__name__
        if why is not None:
            raise TaskUnreadable(
                f"stored task {name!r} cannot be read ({why}); an admin can PUT it again "
                "or DELETE it",
                field="name",
            )
        return spec

    def listing(self) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """(the tasks, shipped and stored, by name; the stored entries that cannot be read,
        as ``{"name", "error"}``: skipped, flagged, never failing the list)."""
        stored = self._stored()
        out = {}
        bad: list[dict[str, str]] = []
        for name, spec in self.shipped.items():
            out[name] = self.describe(name, spec, "model")
        for name, raw in stored.items():
            try:
                out[name] = self.describe(name, self.readable(name, raw), "store")
            except TaskUnreadable as e:
                if not isinstance(raw, Unparsed):  # a bad override is what a GET meets
                    out.pop(name, None)
                bad.append({"name": name, "error": e.message})
        return [out[k] for k in sorted(out)], bad

    def list(self) -> list[dict[str, Any]]:
        return self.listing()[0]

    def names(self) -> list[str]:
        """The task names there are, shipped and stored (shipped only while the store is
        down and nothing was read before): what an unknown-task error lists."""
        try:
            stored = self._stored()
        except StoreUnavailable:
            stored = {}
        return sorted({*self.shipped, *stored})

    def spec(self, name: str) -> tuple[MixSpec, str] | None:
        try:
            raw = self.store.get(name)
            if raw is not None:
                self._last[name] = raw
            else:
                self._last.pop(name, None)
        except StoreUnavailable:
            raw = self._last.get(name)
            if raw is None and name not in self.shipped:
                raise
        if isinstance(raw, Unparsed) and name in self.shipped:
            log.warning("stored task %r is not JSON: the shipped one is served", name)
            raw = None
        if raw is not None:
            return self.readable(name, raw), "store"
        if name in self.shipped:
            return self.shipped[name], "model"
        return None

    def put(self, name: str, spec: MixSpec) -> bool:
        """Store (validated); True when it created a new stored task."""
        spec.validate(self.n_layers, "weights", gamma_field="gamma")
        existed = self.store.get(name) is not None
        self.store.put(name, spec.to_dict())
        self._last[name] = spec.to_dict()
        self.generation += 1
        return not existed

    def delete(self, name: str) -> str:
        """'deleted' | 'read_only' (only shipped) | 'missing'."""
        if self.store.delete(name):
            self._last.pop(name, None)
            self.generation += 1
            return "deleted"
        return "read_only" if name in self.shipped else "missing"
