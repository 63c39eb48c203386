"""Job state: one record per job, the same model whatever runs the jobs.

``FileJobStore`` keeps ``<runs_dir>/<id>/job.json`` (no Redis);
``RedisJobStore`` keeps ``<prefix>:job:<id>`` plus a sorted index. Every change
goes through ``update(id, fn)``, an atomic read-modify-write (a file lock, or
WATCH/MULTI), so the API (cancel), the runner (progress) and the reconciler
(re-queue) never overwrite each other's changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from elmo_service.atomic import write_text

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Phase = Literal["prepare", "train", "export"]
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
JOB_ID = re.compile(r"^j[0-9a-f]{12}$")
MAX_EVENTS = 50


class StoreUnavailable(Exception):
    """The job store (Redis) cannot be reached."""


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None = None
    epoch: int | None = None
    tokens_seen: int = 0
    loss: float | None = None
    perplexity: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    lr: float | None = None
    heldout: dict[str, float] | None = Field(None, description="Last held-out evaluation.")
    checkpoint: str | None = Field(None, description="Newest checkpoint file in the run.")


class Runner(BaseModel):
    """The process running a job: how the reconciler tells whether it is still alive."""

    host: str
    pid: int
    pid_start: str | None = None  # /proc start time: a reused pid is not the same process
    pid_ns: str | None = None  # same hostname in another pid namespace: cannot tell
    worker: str | None = None


class ArtifactInfo(BaseModel):
    name: str
    version: str
    path: str
    step: int | None = None
    tokens_seen: int | None = None
    heldout: dict[str, float] | None = None


class Event(BaseModel):
    at: float
    event: str


class JobRecord(BaseModel):
    id: str
    name: str
    state: JobState = "queued"
    phase: Phase | None = None
    backend: Literal["rq", "local"]
    spec: dict[str, Any] = Field(description="The submitted job, validated.")
    train_config: dict[str, Any] = Field(description="The resolved training config.")
    run_dir: str
    created_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float = Field(default_factory=time.time)
    heartbeat_at: float | None = None
    attempt: int = Field(1, description="Delivery number; a re-queued job gets the next one.")
    losses: int = Field(
        0, description="Times an attempt was lost: its worker died or its trainer was killed."
    )
    last_loss: str | None = Field(None, description="Why the last lost attempt was lost.")
    cancel_requested: bool = False
    progress: Progress = Field(default_factory=Progress)
    log_tail: list[str] = Field(default_factory=list)
    error: str | None = None
    artifact: ArtifactInfo | None = None
    runner: Runner | None = None
    events: list[Event] = Field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def note(self, event: str) -> None:
        self.events.append(Event(at=time.time(), event=event))
        del self.events[:-MAX_EVENTS]

    def finish(self, state: JobState, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.finished_at = time.time()
        self.note(state if error is None else f"{state}: {error}")


Mutator = Callable[[JobRecord], bool]


class JobStore(Protocol):
    def create(self, rec: JobRecord) -> None: ...
    def get(self, job_id: str) -> JobRecord | None: ...
    def list(self) -> list[JobRecord]: ...
    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        """Apply ``fn`` atomically; it returns True to write. -> (record after, written)."""
        ...

    def close(self) -> None: ...


class FileJobStore:
    """``<root>/<id>/job.json``, replaced atomically; updates under ``job.lock`` (flock)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, job_id: str) -> Path:
        return self.root / job_id / "job.json"

    @contextlib.contextmanager
    def _locked(self, job_id: str) -> Iterator[None]:
        lock = self.root / job_id / "job.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, rec: JobRecord) -> None:
        path = self._path(rec.id)
        write_text(path, rec.model_dump_json(indent=1))

    def create(self, rec: JobRecord) -> None:
        (self.root / rec.id).mkdir(parents=True, exist_ok=True)
        with self._locked(rec.id):
            self._write(rec)

    def get(self, job_id: str) -> JobRecord | None:
        if not JOB_ID.match(job_id):
            return None
        try:
            return JobRecord.model_validate_json(self._path(job_id).read_text())
        except FileNotFoundError:
            return None

    def list(self) -> list[JobRecord]:
        out = []
        for p in self.root.glob("j*/job.json") if self.root.is_dir() else []:
            rec = self.get(p.parent.name)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: r.created_at, reverse=True)

    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        if self.get(job_id) is None:
            return None, False
        with self._locked(job_id):
            rec = self.get(job_id)
            if rec is None or not fn(rec):
                return rec, False
            rec.updated_at = time.time()
            self._write(rec)
            return rec, True

    def close(self) -> None:
        pass


class RedisJobStore:
    """``<prefix>:job:<id>`` (JSON) and ``<prefix>:jobs`` (ids by creation time). No expiry:
    the compose Redis evicts only keys with a TTL, so job records are never evicted."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = prefix

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:jobs"

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        import redis

        try:
            yield
        except redis.RedisError as e:
            raise StoreUnavailable(f"job store (redis) unavailable: {e}") from e

    def create(self, rec: JobRecord) -> None:
        with self._errors(), self.r.pipeline() as p:
            p.set(self._key(rec.id), rec.model_dump_json())
            p.zadd(self._index, {rec.id: rec.created_at})
            p.execute()

    def get(self, job_id: str) -> JobRecord | None:
        if not JOB_ID.match(job_id):
            return None
        with self._errors():
            raw = self.r.get(self._key(job_id))
        return None if raw is None else JobRecord.model_validate_json(raw)

    def list(self) -> list[JobRecord]:
        with self._errors():
            ids = [
                i.decode() if isinstance(i, bytes) else i
                for i in self.r.zrevrange(self._index, 0, -1)
            ]
            raws = self.r.mget([self._key(i) for i in ids]) if ids else []
        return [JobRecord.model_validate_json(raw) for raw in raws if raw is not None]

    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        key = self._key(job_id)
        result: list[Any] = [None, False]

        def txn(pipe: Any) -> None:
            raw = pipe.get(key)
            rec = None if raw is None else JobRecord.model_validate_json(raw)
            result[:] = [rec, False]
            if rec is None or not fn(rec):
                return
            rec.updated_at = time.time()
            pipe.multi()
            pipe.set(key, rec.model_dump_json())
            result[1] = True

        if not JOB_ID.match(job_id):
            return None, False
        with self._errors():
            self.r.transaction(txn, key)
        return result[0], result[1]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.r.close()
