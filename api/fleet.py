"""The served model as the fleet's shared desired state (several replicas on one Redis).

``POST /v1/models/{name}/activate`` records the desired artifact (name and version) in
Redis, with a generation from ``INCR`` recorded and published in one Lua script, so
racing activations have one order and the last recorded wins everywhere. Every replica
runs a :class:`FleetAgent` that converges on its own: woken by pub/sub, and polling
every ``ELMO_FLEET_INTERVAL`` seconds (pub/sub drops messages to a disconnected
replica), it loads the desired artifact from its own models folder, warms it and
hot-swaps it in (:meth:`api.holder.ModelHolder.swap`: no request fails). A replica
that cannot (the folder is missing, holds another version, or is broken) keeps serving
what it has, stays ready, reports why in its heartbeat, and retries when the folder
changes. A replica that starts reads the desired state before ``ELMO_MODEL``.

Keys (``<prefix>`` is ``ELMO_REDIS_PREFIX``)::

    <prefix>:fleet:generation       INCR counter
    <prefix>:fleet:desired          JSON {name, version, generation, at, by}
    <prefix>:fleet:events           pub/sub channel (the same JSON)
    <prefix>:fleet:replica:<id>     JSON heartbeat, expires after ELMO_FLEET_TTL
    <prefix>:fleet:replicas         sorted set: id -> heartbeat expiry (an index: no SCAN)

Without Redis none of this runs: one process serves as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from api.artifacts import resolve_artifact
from api.holder import ModelHolder
from api.schemas import ReplicaOut
from api.served import ServedModel
from api.settings import Settings
from elmo_service.artifact import MANIFEST, WEIGHTS, read_manifest
from elmo_service.errors import ArtifactError, ElmoServiceError
from storage import StoreUnavailable, connect, describe, unavailable

log = logging.getLogger("api.fleet")

# INCR and SET in one step: generations are in the order the records were made
_RECORD = """
local g = redis.call('INCR', KEYS[1])
local v = cjson.encode({name=ARGV[1], version=ARGV[2], generation=g, at=tonumber(ARGV[3]), by=ARGV[4]})
redis.call('SET', KEYS[2], v)
redis.call('PUBLISH', KEYS[3], v)
return v
"""

# a Redis that lost the record (restarted without persistence, flushed): a replica puts
# back the last one it read, unless another did first; the counter never goes back
_RESTORE = """
local cur = redis.call('GET', KEYS[2])
if cur then return cur end
local g = tonumber(ARGV[3])
if tonumber(redis.call('GET', KEYS[1]) or '0') < g then redis.call('SET', KEYS[1], g) end
local v = cjson.encode({name=ARGV[1], version=ARGV[2], generation=g, at=tonumber(ARGV[4]), by=ARGV[5]})
redis.call('SET', KEYS[2], v)
redis.call('PUBLISH', KEYS[3], v)
return v
"""


class DesiredMismatch(ArtifactError):
    """The folder of the desired name holds another version than the one activated."""


@dataclass(frozen=True)
class Desired:
    name: str
    version: str
    generation: int
    at: float
    by: str

    @classmethod
    def parse(cls, raw: object) -> Desired:
        try:
            d = json.loads(raw)  # type: ignore[arg-type]
            out = cls(
                str(d["name"]),
                str(d["version"]),
                int(d["generation"]),
                float(d["at"]),
                str(d["by"]),
            )
        except (TypeError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise StoreUnavailable(
                f"fleet state (redis) holds an unreadable desired record: {raw!r:.80}"
            ) from e
        return out

    def ref(self) -> dict[str, Any]:
        d = asdict(self)
        return {"id": d.pop("name"), **d}


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class FleetStore:
    """The fleet's keys in Redis; blocking calls (run them off the event loop).
    Every failure, including a reply of the wrong shape, is :class:`StoreUnavailable`."""

    def __init__(
        self, url: str, prefix: str = "elmo", timeout: float = 0.5, password: Any = None
    ) -> None:
        self.url, self.timeout, self.password = url, timeout, password
        self.client = connect(url, password=password, timeout=timeout)
        base = f"{prefix}:fleet"
        self.k_generation, self.k_desired = f"{base}:generation", f"{base}:desired"
        self.channel, self.k_index = f"{base}:events", f"{base}:replicas"
        self.k_replica = f"{base}:replica:"
        self._record = self.client.register_script(_RECORD)
        self._restore = self.client.register_script(_RESTORE)

    def _call(self, fn, *args, **kw):
        with unavailable("fleet state"):
            return fn(*args, **kw)

    def desired(self) -> Desired | None:
        raw = self._call(self.client.get, self.k_desired)
        if raw is not None and not isinstance(raw, bytes):
            raise StoreUnavailable(f"fleet state (redis) answered garbage: GET {describe(raw)}")
        return None if raw is None else Desired.parse(raw)

    def record(self, name: str, version: str, by: str) -> Desired:
        keys = [self.k_generation, self.k_desired, self.channel]
        raw = self._call(self._record, keys=keys, args=[name, version, time.time(), by])
        return Desired.parse(raw)

    def restore(self, desired: Desired) -> Desired:
        """Put ``desired`` back if Redis holds no record; -> the record Redis holds now."""
        keys = [self.k_generation, self.k_desired, self.channel]
        d = desired
        args = [d.name, d.version, d.generation, d.at, d.by]
        return Desired.parse(self._call(self._restore, keys=keys, args=args))

    def heartbeat(self, replica_id: str, state: dict[str, Any], ttl: float) -> None:
        now = time.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.k_replica + replica_id, json.dumps(state), px=int(ttl * 1000))
        pipe.zadd(self.k_index, {replica_id: now + ttl})
        pipe.zremrangebyscore(self.k_index, "-inf", now)  # replicas that went silent
        self._call(pipe.execute)

    def leave(self, replica_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.k_replica + replica_id)
        pipe.zrem(self.k_index, replica_id)
        self._call(pipe.execute)

    def replicas(self) -> list[dict[str, Any]]:
        ids = self._call(self.client.zrangebyscore, self.k_index, time.time(), "+inf")
        if not isinstance(ids, list):
            raise StoreUnavailable(
                f"fleet state (redis) answered garbage: ZRANGEBYSCORE {describe(ids)}"
            )
        if not ids:
            return []
        raws = self._call(self.client.mget, [self.k_replica + i.decode() for i in ids])
        if not isinstance(raws, list) or len(raws) != len(ids):
            raise StoreUnavailable(f"fleet state (redis) answered garbage: MGET {describe(raws)}")
        out = []
        for raw in raws:
            if raw is None:  # expired between the two calls
                continue
            try:  # what GET /v1/models may show: a stray or foreign entry is left out
                beat = ReplicaOut.model_validate_json(raw).model_dump()
            except (ValidationError, TypeError, ValueError):
                log.debug("fleet: unreadable heartbeat skipped: %r", raw[:200])
                continue
            out.append(beat)
        return sorted(out, key=lambda b: str(b["id"]))

    def pubsub(self):
        """A pub/sub connection of its own: no read timeout (it waits for messages), a
        health check every 5 s so a dead connection is noticed."""
        client = connect(
            self.url,
            password=self.password,
            timeout=None,
            connect_timeout=self.timeout,
            retries=None,
            health_check_interval=5,
        )
        ps = client.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(self.channel)
        return client, ps

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


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
    from api.loading import load_served_model

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
        load,  # async (path) -> ServedModel, loaded and warmed (api.activation.load_warm)
        replica_id: str | None = None,
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
                if desired is None and self.desired is not None:  # Redis lost it
                    desired = await self.call(self.store.restore, self.desired)
                    log.warning("fleet: redis had no desired model; restored %s", desired)
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

    def _redis_ok(self) -> None:
        if self.redis_error is not None:
            log.info("fleet: redis reachable again")
        self.redis_error = None

    def _redis_failed(self, e: Exception) -> None:
        if self.redis_error is None:
            log.warning("fleet: %s; serving on, retrying every %.1fs", e, self.interval)
        self.redis_error = str(e)

    async def converge(self, desired: Desired) -> None:
        """Serve ``desired`` if this replica can; else keep serving and report why."""
        async with self.lock:
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
            await self.swap(served)
            log.info("fleet: converged on %s (version %s)", desired.name, desired.version)
        await self.beat()

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
            replicas = await self.call(self.store.replicas)
            error = None
        except StoreUnavailable as e:
            desired, replicas, error = self.desired, [], str(e)
        replicas = [r for r in replicas if r.get("id") != self.id] + [me]
        replicas.sort(key=lambda r: str(r["id"]))
        return fleet_summary(desired, replicas, self.id, error)


def fleet_summary(
    desired: Desired | None,
    replicas: list[dict[str, Any]],
    me: str,
    error: str | None = None,
    shared: bool = True,
) -> dict[str, Any]:
    """``agree``: every replica serves one version (the desired one, when there is one)."""
    want = None if desired is None else {"id": desired.name, "version": desired.version}
    served = [r.get("served") for r in replicas]
    versions = {None if s is None else (s.get("id"), s.get("version")) for s in served}
    converged = sum(1 for s in served if want is not None and s == want)
    agree = len(versions) == 1 and (want is None or converged == len(replicas))
    for r in replicas:
        r["self"] = r.get("id") == me
    return {
        "shared": shared,
        "desired": None if desired is None else desired.ref(),
        "agree": agree,
        "converged": converged if want is not None else None,
        "replicas_total": len(replicas),
        "replicas": replicas,
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
        "state": "serving",
        "error": None,
        "generation": None,
        "started_at": None,
        "heartbeat_at": time.time(),
    }
    return fleet_summary(None, [me], replica_id, shared=False)
