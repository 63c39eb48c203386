"""Job state: one record per job, the same model whatever runs the jobs.

``FileJobStore`` keeps ``<runs_dir>/<id>/job.json`` (no Redis);
``RedisJobStore`` keeps ``<prefix>:job:<id>`` plus a sorted index, and mirrors each
state change into the run folder's ``job.json`` (so a Redis that comes back empty
loses no job: :meth:`elmo_jobs.backend.RqBackend.adopt_orphans`). Every change goes
through ``update(id, fn)``, an atomic read-modify-write (a file lock, or
WATCH/MULTI), so the API (cancel), the runner (progress) and the reconciler
(re-queue) never overwrite each other's changes.

A record that cannot be read (damaged, or written by an incompatible version) never
fails a list, a submit or the recovery loop: it is logged, counted in
``store.unreadable`` and skipped. Figures are ``float | None``: a non-finite one (a
diverged run's loss) is stored as ``null``.

A Redis that answers, but not with what a command returns (a wrong type or length: a
misbehaving proxy or "Redis-compatible" server), is a store failure like one that does
not answer: every reply is checked, and what redis-py or rq raise on such a reply is
turned into :class:`StoreUnavailable` in one place (:func:`store_errors`), so the API
answers 503 and the workers treat it as an outage.

Model names are reserved atomically (``reserve``: Redis ``SET NX`` under WATCH, or
a lock file): of many concurrent submits for one name, one wins.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from elmo_service.atomic import write_text
from elmo_storage import StoreUnavailable as StoreUnavailable  # re-exported: jobs.StoreUnavailable
from elmo_storage import expect, file_lock, unavailable

log = logging.getLogger("jobs")

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Phase = Literal["prepare", "train", "export"]
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
JOB_ID = re.compile(r"^j[0-9a-f]{12}$")
MAX_EVENTS = 50


class _Own(Exception):
    """An exception our own callback raised inside a Redis transaction, carried past
    :func:`store_errors` so a bug of ours is not reported as the store's garbage."""


def own(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a mutator, a name check) to run inside :func:`store_errors`: whatever it
    raises comes out unchanged."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - not handled: re-raised as is by store_errors
            raise _Own() from e

    return call


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """A job-store (Redis, rq) failure becomes :class:`StoreUnavailable`
    (:func:`storage.unavailable`); an exception of our own passes unchanged (see :func:`own`)."""
    try:
        with unavailable("job store"):
            yield
    except _Own as e:
        raise e.__cause__ from None  # type: ignore[misc]


def _string(reply: object, what: str) -> str | bytes | None:
    """A GET's reply: a string, or nil."""
    expect(reply is None or isinstance(reply, bytes | str), what, reply)
    return reply  # type: ignore[return-value]


def _is_count(reply: object) -> bool:
    return isinstance(reply, int) and not isinstance(reply, bool)


class Unreadable(Exception):
    """A stored record that does not parse as a :class:`JobRecord`."""

    def __init__(self, job_id: str, why: str) -> None:
        super().__init__(f"job {job_id}: record unreadable: {why}")
        self.job_id, self.why = job_id, why


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# A figure from training: NaN/inf (a diverged run) is kept as null, never as a bare NaN
Figure = Annotated[float | None, BeforeValidator(_finite_or_none)]


def figure(v: Any) -> float | None:
    """A metrics-log value as a :data:`Figure` (numbers only; anything else: None)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None = None
    epoch: int | None = None
    tokens_seen: int = 0
    loss: Figure = None
    perplexity: Figure = None
    tokens_per_s: Figure = None
    elapsed_s: Figure = None
    eta_s: Figure = None
    lr: Figure = None
    heldout: dict[str, Figure] | None = Field(None, description="Last held-out evaluation.")
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
    heldout: dict[str, Figure] | None = None


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
    hint: str | None = Field(
        None, description="Why a queued job does not start (e.g. no worker seen); not stored."
    )

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
# whether a job that holds a name reservation (its id, seconds since it reserved) has
# let it go: gone, failed or cancelled
NameFree = Callable[[str, float], bool]
NAME_GRACE = 60.0  # a reservation's job record may not be written yet: seconds it is kept


class JobStore(Protocol):
    unreadable: dict[str, str]  # id -> why, as of the last list()
    unreadable_seen: int  # unreadable records met, in total (a counter)

    def create(self, rec: JobRecord) -> None: ...
    def create_if_absent(self, rec: JobRecord) -> bool: ...
    def get(self, job_id: str) -> JobRecord | None:
        """None when there is no such record; Unreadable when it does not parse."""
        ...

    def list(self) -> list[JobRecord]:
        """Every readable record, newest first; unreadable ones are skipped (logged)."""
        ...

    def ids(self) -> set[str]: ...
    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        """Apply ``fn`` atomically; it returns True to write. -> (record after, written)."""
        ...

    def reserve(self, name: str, job_id: str, free: NameFree) -> str | None:
        """Reserve model ``name`` for ``job_id`` unless a live job holds it (its id)."""
        ...

    def close(self) -> None: ...


class _Tolerant:
    """Parsing shared by both stores: an unreadable record is reported and skipped."""

    def __init__(self) -> None:
        self.unreadable: dict[str, str] = {}
        self.unreadable_seen = 0

    def _parse(self, job_id: str, raw: str | bytes) -> JobRecord:
        try:
            return JobRecord.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            why = f"{where + ': ' if where else ''}{first.get('msg', str(e))}"
            raise Unreadable(job_id, why[:300]) from e

    def _parse_all(self, pairs: list[tuple[str, str | bytes]]) -> list[JobRecord]:
        out, bad = [], {}
        for job_id, raw in pairs:
            try:
                out.append(self._parse(job_id, raw))
            except Unreadable as e:
                bad[job_id] = e.why
        for job_id, why in bad.items():
            if job_id not in self.unreadable:
                log.error("job %s: record unreadable, skipped: %s", job_id, why)
            self.unreadable_seen += 1
        self.unreadable = bad
        return out


def _reservation(job_id: str) -> str:
    return f"{job_id} {time.time():.3f}"


def _holder(raw: str | bytes | None) -> tuple[str, float] | None:
    """(job id, seconds since it reserved) of a stored reservation."""
    if not raw:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    job_id, _, at = text.strip().partition(" ")
    try:
        return job_id, time.time() - float(at)
    except ValueError:
        return job_id, float("inf")


def name_holder_free(store: JobStore) -> NameFree:
    """A reservation is free when its job is gone, failed or cancelled; an unreadable
    holder keeps it (we cannot tell)."""

    def free(job_id: str, age: float) -> bool:
        try:
            rec = store.get(job_id)
        except Unreadable:
            return False
        if rec is None:  # reserved, but its record never came (a crash between the two)
            return age > NAME_GRACE
        return rec.state in ("failed", "cancelled")

    return free


class FileJobStore(_Tolerant):
    """``<root>/<id>/job.json``, replaced atomically; updates under ``job.lock`` (flock).
    Name reservations: ``<root>/.names/<name>`` (the job id), under ``.names/.lock``."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)

    def _path(self, job_id: str) -> Path:
        return self.root / job_id / "job.json"

    def _locked(self, job_id: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.root / job_id / "job.lock")

    def _write(self, rec: JobRecord) -> None:
        path = self._path(rec.id)
        write_text(path, rec.model_dump_json(indent=1))

    def create(self, rec: JobRecord) -> None:
        (self.root / rec.id).mkdir(parents=True, exist_ok=True)
        with self._locked(rec.id):
            self._write(rec)

    def create_if_absent(self, rec: JobRecord) -> bool:
        (self.root / rec.id).mkdir(parents=True, exist_ok=True)
        with self._locked(rec.id):
            if self._path(rec.id).exists():
                return False
            self._write(rec)
            return True

    def _read(self, job_id: str) -> bytes | None:
        try:
            return self._path(job_id).read_bytes()
        except FileNotFoundError:
            return None

    def get(self, job_id: str) -> JobRecord | None:
        if not JOB_ID.match(job_id):
            return None
        raw = self._read(job_id)
        return None if raw is None else self._parse(job_id, raw)

    def ids(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        return {p.parent.name for p in self.root.glob("j*/job.json") if JOB_ID.match(p.parent.name)}

    def list(self) -> list[JobRecord]:
        pairs = []
        for job_id in self.ids():
            try:
                raw = self._read(job_id)
            except OSError as e:  # unreadable file (permissions, I/O): reported like bad JSON
                raw = f"<{type(e).__name__}: {e}>".encode()
            if raw is not None:
                pairs.append((job_id, raw))
        return sorted(self._parse_all(pairs), key=lambda r: r.created_at, reverse=True)

    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        if not JOB_ID.match(job_id) or not self._path(job_id).exists():
            return None, False
        with self._locked(job_id):
            rec = self.get(job_id)
            if rec is None or not fn(rec):
                return rec, False
            rec.updated_at = time.time()
            self._write(rec)
            return rec, True

    def reserve(self, name: str, job_id: str, free: NameFree) -> str | None:
        names = self.root / ".names"
        with file_lock(names / ".lock"):
            path = names / name
            held = _holder(path.read_text() if path.exists() else None)
            if held and held[0] != job_id and not free(*held):
                return held[0]
            write_text(path, _reservation(job_id))
            return None

    def close(self) -> None:
        pass


class RedisJobStore(_Tolerant):
    """``<prefix>:job:<id>`` (JSON), ``<prefix>:jobs`` (ids by creation time) and
    ``<prefix>:jobname:<name>`` (the job that builds it). No expiry: the compose Redis
    evicts only keys with a TTL, so job records are never evicted.

    ``mirror``: write each state change to the run folder's ``job.json`` too (when
    the runs folder is visible here), from which a Redis that lost its data is refilled.
    """

    def __init__(self, client: Any, prefix: str, mirror: bool = True) -> None:
        super().__init__()
        self.r = client
        self.prefix = prefix
        self.mirror = mirror

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _name_key(self, name: str) -> str:
        return f"{self.prefix}:jobname:{name}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:jobs"

    def _ids(self, reply: object, what: str) -> list[str]:
        """A ZRANGE's reply: job ids (members that are not one are not ours: skipped)."""
        expect(isinstance(reply, list), what, reply)
        expect(all(isinstance(i, bytes | str) for i in reply), what, reply)  # type: ignore[union-attr]
        ids = [i.decode() if isinstance(i, bytes) else i for i in reply]  # type: ignore[union-attr]
        return [i for i in ids if JOB_ID.match(i)]

    def _mirror(self, rec: JobRecord) -> None:
        run = Path(rec.run_dir)
        if not (self.mirror and run.parent.is_dir()):
            return
        try:
            run.mkdir(exist_ok=True)
            write_text(run / "job.json", rec.model_dump_json(indent=1))
        except OSError as e:
            log.warning("job %s: run-folder copy of the record not written: %s", rec.id, e)

    def create(self, rec: JobRecord) -> None:
        with store_errors(), self.r.pipeline() as p:
            p.set(self._key(rec.id), rec.model_dump_json())
            p.zadd(self._index, {rec.id: rec.created_at})
            replies = p.execute()
            expect(
                isinstance(replies, list) and len(replies) == 2 and replies[0] is True
                and _is_count(replies[1]),
                "SET + ZADD", replies,
            )  # fmt: skip
        self._mirror(rec)

    def create_if_absent(self, rec: JobRecord) -> bool:
        with store_errors():
            done = self.r.set(self._key(rec.id), rec.model_dump_json(), nx=True)
            expect(done is True or done is None, "SET NX", done)  # redis-py: +OK -> True
            if done is None:
                return False
            added = self.r.zadd(self._index, {rec.id: rec.created_at})
            expect(_is_count(added), "ZADD", added)
        self._mirror(rec)
        return True

    def get(self, job_id: str) -> JobRecord | None:
        if not JOB_ID.match(job_id):
            return None
        with store_errors():
            raw = _string(self.r.get(self._key(job_id)), "GET")
        return None if raw is None else self._parse(job_id, raw)

    def ids(self) -> set[str]:
        with store_errors():
            return set(self._ids(self.r.zrange(self._index, 0, -1), "ZRANGE"))

    def list(self) -> list[JobRecord]:
        with store_errors():
            ids = self._ids(self.r.zrevrange(self._index, 0, -1), "ZREVRANGE")
            raws = self.r.mget([self._key(i) for i in ids]) if ids else []
            expect(isinstance(raws, list) and len(raws) == len(ids), f"MGET of {len(ids)}", raws)
            for raw in raws:
                _string(raw, "MGET")
        return self._parse_all(
            [(i, raw) for i, raw in zip(ids, raws, strict=True) if raw is not None]
        )

    def update(self, job_id: str, fn: Mutator) -> tuple[JobRecord | None, bool]:
        key = self._key(job_id)
        result: list[Any] = [None, False, False]

        mutate = own(fn)

        def txn(pipe: Any) -> None:
            raw = _string(pipe.get(key), "GET")
            rec = None if raw is None else self._parse(job_id, raw)
            result[:] = [rec, False, False]
            if rec is None:
                return
            before = (rec.state, rec.attempt, rec.cancel_requested)
            if not mutate(rec):
                return
            rec.updated_at = time.time()
            pipe.multi()
            pipe.set(key, rec.model_dump_json())
            result[1] = True
            result[2] = before != (rec.state, rec.attempt, rec.cancel_requested)

        if not JOB_ID.match(job_id):
            return None, False
        with store_errors():
            replies = self.r.transaction(txn, key)
            if result[1]:
                expect(replies == [True], "MULTI/SET/EXEC", replies)
        if result[2]:
            self._mirror(result[0])
        return result[0], result[1]

    def reserve(self, name: str, job_id: str, free: NameFree) -> str | None:
        key = self._name_key(name)
        holder: list[str | None] = [None]

        is_free = own(free)

        def txn(pipe: Any) -> None:
            held = _holder(_string(pipe.get(key), "GET"))
            holder[0] = None
            if held and held[0] != job_id and not is_free(*held):
                holder[0] = held[0]
                return
            pipe.multi()
            pipe.set(key, _reservation(job_id))

        with store_errors():
            replies = self.r.transaction(txn, key)
            if holder[0] is None:
                expect(replies == [True], "MULTI/SET/EXEC", replies)
        return holder[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.r.close()
