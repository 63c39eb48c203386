"""The served model as the fleet's shared desired state (several replicas on one Redis).

``POST /v1/models/{name}/activate`` records the desired artifact (name and version) in
Redis, with a generation from ``INCR`` recorded and published in one Lua script, so
racing activations have one order and the last recorded wins everywhere. Every replica
runs a :class:`FleetAgent` that converges on its own: woken by pub/sub, and polling
every ``ELMO_FLEET_INTERVAL`` seconds (pub/sub drops messages to a disconnected
replica), it loads the desired artifact from its own models folder, warms it and
hot-swaps it in (:meth:`elmo_api.holder.ModelHolder.swap`: no request fails). A replica
that cannot (the folder is missing, holds another version, or is broken) keeps serving
what it has, stays ready, reports why in its heartbeat, and retries when the folder
changes. A replica that starts reads the desired state before ``ELMO_MODEL``.

The keys and the scripts are :mod:`elmo_api.fleet_store`'s. Generations never go back: an
agent that holds a newer record than Redis (a Redis restarted from an older snapshot,
or empty) puts it back and logs it. No view claims what it cannot see: ``agree`` is
false while the desired record cannot be read, a replica is missing (silent without
leaving) or its heartbeat is unreadable, or the answering replica has not read the
fleet's state for over ``ELMO_FLEET_TTL`` (``stale``; also ``/metrics``
``elmo_fleet_stale``, and ``/readyz`` per ``ELMO_FLEET_STALE_READY``).

Without Redis none of this runs: one process serves as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elmo_api.artifacts import resolve_artifact
from elmo_api.fleet_store import Desired, FleetStore, Members, new_op
from elmo_api.holder import ModelHolder
from elmo_api.selftest import summary as selftest_summary
from elmo_api.served import ServedModel
from elmo_api.settings import Settings
from elmo_service.artifact import MANIFEST, WEIGHTS, read_manifest
from elmo_service.errors import ArtifactError, ElmoServiceError
from elmo_storage import StoreUnavailable, never_sent

log = logging.getLogger("elmo_api.fleet")


READBACK_SECONDS = 5.0  # how long an activation whose record stalled reads it back


class DesiredMismatch(ArtifactError):
    """The folder of the desired name holds another version than the one activated."""


class NotRecorded(StoreUnavailable):
    """The activation is not the fleet's model: Redis was not reached, or was read back
    and holds another record."""


class OutcomeUnknown(StoreUnavailable):
    """The record was sent, Redis did not answer, and could not be read back: it may have
    landed. Reading ``GET /v1/models`` tells; activating again is safe (a no-op once in)."""


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def fleet_store(settings: Settings) -> FleetStore | None:
    if not settings.redis_url:
        return None
    return FleetStore(
        settings.redis_url,
        settings.redis_prefix,
        timeout=max(settings.redis_timeout, 0.5),
        password=settings.redis_password,
    )


def serves(served: ServedModel | None, desired: Desired) -> bool:
    return served is not None and (served.name, served.version) == (desired.name, desired.version)


def desired_path(settings: Settings, desired: Desired) -> Path:
    """The desired artifact's folder here, checked against the recorded version (cheap: its
    manifest); LookupError when missing, DesiredMismatch when it holds another version."""
    path = resolve_artifact(settings.models_dir, desired.name)
    have = read_manifest(path).get("version")
    if have != desired.version:
        raise DesiredMismatch(
            f"{path} holds version {have}, the fleet serves {desired.version}", field="version"
        )
    return path


def startup_model_path(settings: Settings, store: FleetStore | None) -> tuple[Path, str | None]:
    """The folder a starting replica serves: the fleet's desired artifact when one was
    activated and is here at that version, else ELMO_MODEL(_PATH). -> (path, why not desired)."""
    default = Path(settings.resolved_model_path)
    if store is None:
        return default, None
    try:
        desired = store.desired()
    except StoreUnavailable as e:
        return default, f"cannot read the fleet's desired model ({e}); serving {default.name}"
    if desired is None:
        return default, None
    try:
        return desired_path(settings, desired).resolve(), None
    except LookupError:
        why = f"no model {desired.name!r} in {settings.models_dir}"
    except ElmoServiceError as e:
        why = e.message
    return default, f"cannot serve the fleet's model {desired.name} ({desired.version}): {why}"


def load_startup_model(
    settings: Settings,
    store: FleetStore | None,
    backend: Any,
    io: ThreadPoolExecutor,
    metrics: Any = None,
    artifact: Any = None,
) -> tuple[ServedModel, str | None]:
    """The model a starting replica serves (blocking): the fleet's desired one, or
    ELMO_MODEL when none was activated or it cannot be loaded here (-> the reason, which
    the replica reports while it retries). ``artifact``: one already loaded by ``serve``."""
    from elmo_api.loading import load_served_model

    path, note = startup_model_path(settings, store)
    try:
        return load_served_model(settings, backend, io, metrics, path, artifact), note
    except ElmoServiceError as e:
        if path == Path(settings.resolved_model_path):
            raise
        note = f"cannot serve the fleet's model from {path}: {e.message}"
    log.warning("fleet: %s; serving %s meanwhile", note, settings.resolved_model_path)
    return load_served_model(settings, backend, io, metrics, None, artifact), note


def _disk_key(settings: Settings, name: str) -> tuple:
    """What the desired folder looks like now: a failed load is retried when it changes."""
    try:
        path = resolve_artifact(settings.models_dir, name)
        m, w = (path / MANIFEST).stat(), (path / WEIGHTS).stat()
        return (str(path), m.st_mtime_ns, m.st_size, w.st_mtime_ns, w.st_size)
    except (LookupError, ElmoServiceError, OSError):
        return ("missing",)


class FleetAgent:
    """This replica's part of the fleet: heartbeats, the pub/sub listener, convergence.

    ``lock`` serialises every load-and-swap of this replica (convergence and the
    activate route), so a swap never undoes a newer one.
    """

    def __init__(
        self,
        settings: Settings,
        store: FleetStore,
        holder: ModelHolder,
        load,  # async (path) -> ServedModel, loaded and warmed (elmo_api.activation.load_warm)
        replica_id: str | None = None,
        metrics: Any = None,
    ) -> None:
        self.settings, self.store, self.holder, self._load = settings, store, holder, load
        self.id = replica_id or settings.replica_id or default_replica_id()
        self.host = socket.gethostname()
        self.interval, self.ttl = settings.fleet_interval, settings.fleet_ttl
        self.lock = asyncio.Lock()
        self.state = "serving"
        self.error: str | None = None
        self.desired: Desired | None = None
        self.redis_error: str | None = None
        self.started_at = time.time()
        self.read_at: float | None = None  # the last successful read of the desired record
        if metrics is not None:  # evaluated at each scrape
            metrics.fleet_state_age.set_function(self.state_age)
            metrics.fleet_stale.set_function(lambda: float(self.stale))
        self._failed: tuple | None = None  # (generation, disk key) of the last failed load
        self._wake = asyncio.Event()
        self._stop = threading.Event()
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="elmo-fleet")
        self._tasks: list[asyncio.Task] = []
        self._listener: threading.Thread | None = None

    # -- blocking calls, on the agent's own threads (never the event loop's executor) --
    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self, note: str | None = None) -> None:
        if note:  # started on ELMO_MODEL, not the fleet's model: say why until converged
            self.state, self.error = "failed", note
        try:  # joined at once when Redis answers (the converge loop reads it again next)
            await self.call(self.store.desired)
            self.read_at = time.time()
        except StoreUnavailable as e:
            self._redis_failed(e)
        loop = asyncio.get_running_loop()
        self._listener = threading.Thread(
            target=self._listen, args=(loop,), name="elmo-fleet-pubsub", daemon=True
        )
        self._listener.start()
        self._tasks = [
            asyncio.create_task(self._converge_loop(), name="fleet-converge"),
            asyncio.create_task(self._beat_loop(), name="fleet-heartbeat"),
        ]

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        with contextlib.suppress(StoreUnavailable):
            await self.call(self.store.leave, self.id)
        if self._listener is not None:
            await asyncio.to_thread(self._listener.join, 5)
        self._io.shutdown(wait=False)
        self.store.close()

    def wake(self) -> None:
        self._wake.set()

    # -- pub/sub: only wakes the converge loop; it reads the state itself --------------
    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            client = ps = None
            try:
                client, ps = self.store.pubsub()
                loop.call_soon_threadsafe(self._wake.set)  # (re)subscribed: catch up
                while not self._stop.is_set():
                    if ps.get_message(timeout=1.0) is not None:
                        loop.call_soon_threadsafe(self._wake.set)
            except Exception as e:  # noqa: BLE001 - Redis away: polling goes on; retry
                log.debug("fleet pub/sub: %s", e)
                self._stop.wait(self.interval)
            finally:
                for c in (ps, client):
                    if c is not None:
                        with contextlib.suppress(Exception):
                            c.close()

    # -- the loops ---------------------------------------------------------------------
    async def _beat_loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval)

    async def _converge_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                desired = await self.call(self.store.desired)
                self.read_at = time.time()
                desired = await self._never_back(desired)
                self._redis_ok()
                self.desired = desired
                if desired is not None:
                    await self.converge(desired)
                elif self.state == "failed":  # e.g. Redis was down at start: nothing to serve
                    self.state, self.error = "serving", None
            except StoreUnavailable as e:
                self._redis_failed(e)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the agent never dies; the next tick retries
                log.exception("fleet: convergence failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)

    async def _never_back(self, desired: Desired | None) -> Desired | None:
        """Redis lost the record, or holds an older one than this agent has read (restarted
        from an older snapshot, a restored backup): put ours back, never roll back."""
        mine = self.desired
        if mine is None or (desired is not None and desired.generation >= mine.generation):
            return desired
        now = await self.call(self.store.restore, mine)
        held = "no desired model" if desired is None else (
            f"{desired.name} ({desired.version}) at generation {desired.generation}"
        )  # fmt: skip
        log.warning(
            "fleet: redis held %s, older than %s (%s) at generation %d here: put back; now %s "
            "at generation %d",
            held, mine.name, mine.version, mine.generation, now.name, now.generation,
        )  # fmt: skip
        return now

    def state_age(self) -> float:
        """Seconds since this replica last read the fleet's desired record (since it
        started, when it never has)."""
        return time.time() - (self.read_at or self.started_at)

    @property
    def stale(self) -> bool:
        return self.state_age() > self.ttl

    @property
    def joined(self) -> bool:
        """It has read the fleet's desired record since it started. Until then it cannot
        know which model the fleet serves, and no other replica can see it (its heartbeat
        does not reach Redis either): /readyz says 503 ``fleet_unjoined``, whatever
        ELMO_FLEET_STALE_READY says, so a balancer sends it nothing (#50 item 8: a replica
        restarted against a Redis it could not read served the old model through the
        balancer while the others' views said ``agree: true, converged 2/2``). Requests
        sent to it directly are still answered, naming their model (X-Model-Version)."""
        return self.read_at is not None

    def unjoined_message(self) -> str:
        return (
            "this replica has not read the fleet's desired model since it started "
            f"({self.redis_error or 'no answer yet'}): it cannot tell which model the fleet "
            "serves, so it stays out of rotation until it can"
        )

    def _redis_ok(self) -> None:
        if self.redis_error is not None:
            log.info("fleet: redis reachable again")
        self.redis_error = None

    def _redis_failed(self, e: Exception) -> None:
        if self.redis_error is None:
            log.warning("fleet: %s; serving on, retrying every %.1fs", e, self.interval)
        self.redis_error = str(e)

    async def record(self, name: str, version: str) -> Desired:
        """Record ``name``/``version`` as the fleet's model (call it holding ``lock``).

        A record that never reached Redis (no connection) is sent again for up to
        ``READBACK_SECONDS`` (recording is idempotent). One that failed after reaching it (a
        stall past the timeout) may still land: it is read back, twice in a row (the second
        read is queued behind whatever the stalled Redis had pending, our record included),
        for up to ``READBACK_SECONDS``. -> the record (ours, or the same model already
        recorded); NotRecorded or OutcomeUnknown otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READBACK_SECONDS
        op = new_op()
        seen = self.desired.generation if self.desired is not None else 0
        while True:
            try:
                rec = await self.call(self.store.record, name, version, self.id, seen, op)
                break
            except StoreUnavailable as e:
                if not never_sent(e):
                    rec = await self._read_back(name, version, op, e)
                    break
                if loop.time() >= deadline:
                    raise NotRecorded(f"{e}; nothing changed") from e
                await asyncio.sleep(0.2)
        self.desired = rec
        return rec

    async def _read_back(self, name: str, version: str, op: str, failure: Exception) -> Desired:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READBACK_SECONDS
        reads: list[Desired | None] = []
        while len(reads) < 2:
            try:
                reads.append(await self.call(self.store.desired))
            except StoreUnavailable as e:
                reads.clear()
                if loop.time() >= deadline:
                    raise OutcomeUnknown(
                        f"the record of {name} ({version}) was sent and redis did not answer "
                        f"({failure}), nor a read-back for {READBACK_SECONDS:.0f}s ({e})"
                    ) from e
                await asyncio.sleep(0.2)
        now = reads[-1]
        if now is not None and (now.op == op or (now.name, now.version) == (name, version)):
            log.warning(
                "fleet: recording %s did not answer (%s); read back: recorded at generation %d",
                name, failure, now.generation,
            )  # fmt: skip
            return now
        held = (
            "no record"
            if now is None
            else f"{now.name} ({now.version}), generation {now.generation}"
        )
        raise NotRecorded(
            f"recording {name} did not answer ({failure}); read back: the fleet's model is "
            f"{held}, not {name}"
        ) from failure

    async def converge(self, desired: Desired) -> None:
        """Serve ``desired`` if this replica can; else keep serving and report why."""
        async with self.lock:
            if self._superseded(desired):
                return  # a newer record came in while this waited (an activation here)
            if serves(self.holder.current, desired):
                self.state, self.error, self._failed = "serving", None, None
                return
            key = (desired.generation, await self.call(_disk_key, self.settings, desired.name))
            if key == self._failed:
                return  # failed on this very folder: retried once it changes
            self.state = "loading"
            await self.beat()
            try:
                path = await self.call(desired_path, self.settings, desired)
                served = await self._load(path)
                if served.version != desired.version:  # replaced between the check and the load
                    await asyncio.to_thread(served.close)
                    raise DesiredMismatch(
                        f"{path} holds version {served.version}, the fleet serves "
                        f"{desired.version}",
                        field="version",
                    )
            except (LookupError, ElmoServiceError, OSError) as e:
                why = (
                    f"no model {desired.name!r} in {self.settings.models_dir}"
                    if isinstance(e, LookupError)
                    else getattr(e, "message", str(e))
                )
                cur = self.holder.current
                self.state, self._failed = "failed", key
                self.error = f"cannot serve {desired.name} ({desired.version}): {why}"
                log.warning(
                    "fleet: %s; still serving %s", self.error, cur.name if cur else "nothing"
                )
                await self.beat()
                return
            if self._superseded(desired):  # a newer record came in during the load
                await asyncio.to_thread(served.close)
                return
            await self.swap(served)
            log.info("fleet: converged on %s (version %s)", desired.name, desired.version)
        await self.beat()

    def _superseded(self, desired: Desired) -> bool:
        """A newer record than ``desired`` is known here: converging on it would roll back."""
        return self.desired is not None and self.desired.generation > desired.generation

    async def swap(self, served: ServedModel) -> ServedModel | None:
        """Swap in ``served`` (already loaded and warmed); call it holding ``lock``."""
        try:
            old = await self.holder.swap(served)
        except BaseException:
            await asyncio.to_thread(served.close)
            raise
        self.state, self.error, self._failed = "serving", None, None
        return old

    # -- reporting -----------------------------------------------------------------------
    def heartbeat(self) -> dict[str, Any]:
        cur = self.holder.current
        return {
            "id": self.id,
            "host": self.host,
            "pid": os.getpid(),
            "served": None if cur is None else {"id": cur.name, "version": cur.version},
            "selftest": selftest_summary(cur),  # a replica whose vectors are wrong says so
            "state": self.state,
            "error": self.error,
            "generation": None if self.desired is None else self.desired.generation,
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
        }

    async def beat(self) -> None:
        try:
            await self.call(self.store.heartbeat, self.id, self.heartbeat(), self.ttl)
            self._redis_ok()
        except StoreUnavailable as e:
            self._redis_failed(e)

    async def view(self) -> dict[str, Any]:
        """The fleet as Redis knows it (this replica's own entry live, not its last beat)."""
        me = self.heartbeat()
        try:
            desired = await self.call(self.store.desired)
            self.read_at = time.time()
            members = await self.call(self.store.members)
            error = None
        except StoreUnavailable as e:
            desired, members, error = self.desired, Members([], []), str(e)
        if desired is not None and self.desired is not None:  # never show an older one
            desired = max(desired, self.desired, key=lambda d: d.generation)
        replicas = [r for r in members.live if r.get("id") != self.id] + [me]
        replicas.sort(key=lambda r: str(r["id"]))
        missing = [m for m in members.missing if m != self.id]
        return fleet_summary(
            desired, replicas, self.id, error, missing=missing,
            unreadable=members.unreadable, state_age=self.state_age(), stale=self.stale,
        )  # fmt: skip


def fleet_summary(
    desired: Desired | None,
    replicas: list[dict[str, Any]],
    me: str,
    error: str | None = None,
    shared: bool = True,
    missing: list[str] | None = None,
    unreadable: int = 0,
    state_age: float | None = None,
    stale: bool = False,
) -> dict[str, Any]:
    """``agree``: every replica serves one version (the desired one, when there is one),
    and this view saw it all: the desired record read now, every replica accounted for
    (none ``missing``, no ``unreadable`` heartbeat), this replica's state not ``stale``."""
    want = None if desired is None else {"id": desired.name, "version": desired.version}
    served = [r.get("served") for r in replicas]
    versions = {None if s is None else (s.get("id"), s.get("version")) for s in served}
    converged = sum(1 for s in served if want is not None and s == want)
    missing = missing or []
    seen_all = error is None and not missing and not unreadable and not stale
    agree = seen_all and len(versions) == 1 and (want is None or converged == len(replicas))
    for r in replicas:
        r["self"] = r.get("id") == me
    return {
        "shared": shared,
        "desired": None if desired is None else desired.ref(),
        "agree": agree,
        "converged": converged if want is not None else None,
        "replicas_total": len(replicas),
        "replicas": replicas,
        "missing": missing,
        "unreadable": unreadable,
        "state_age": state_age,
        "stale": stale,
        "error": error,
    }


def standalone_view(holder: ModelHolder, replica_id: str) -> dict[str, Any]:
    """Without Redis: a fleet of one, this process."""
    cur = holder.current
    me = {
        "id": replica_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "served": None if cur is None else {"id": cur.name, "version": cur.version},
        "selftest": selftest_summary(cur),
        "state": "serving",
        "error": None,
        "generation": None,
        "started_at": None,
        "heartbeat_at": time.time(),
    }
    return fleet_summary(None, [me], replica_id, shared=False)
