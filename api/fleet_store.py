"""The fleet's keys in Redis (:class:`FleetStore`) and its desired record (:class:`Desired`).

Keys (``<prefix>`` is ``ELMO_REDIS_PREFIX``)::

    <prefix>:fleet:generation       the counter (never goes back; see below)
    <prefix>:fleet:desired          JSON {name, version, generation, at, by, op}
    <prefix>:fleet:events           pub/sub channel (the same JSON)
    <prefix>:fleet:replica:<id>     JSON heartbeat, expires after ELMO_FLEET_TTL
    <prefix>:fleet:replicas         sorted set: id -> heartbeat expiry (an index: no SCAN)

Generations never go back. A record is made in one Lua script above both the counter
and every generation the recording replica has seen (a Redis restored from an older
snapshot has an older counter); recording the fleet's current model again changes
nothing (a retried activation is a no-op). A replica that holds a newer record than
Redis puts it back (:meth:`FleetStore.restore`), as it does for an empty Redis.

A replica that stops beating without leaving stays in the index for
``FORGET_TTLS`` heartbeat lifetimes: the views list it as ``missing`` meanwhile (they
cannot account for it), then it is forgotten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from elmo_api.schemas import ReplicaOut
from elmo_storage import StoreUnavailable, connect, describe, unavailable

log = logging.getLogger("elmo_api.fleet")

FORGET_TTLS = 6  # a silent replica is listed missing this many heartbeat lifetimes

# the generation floor: above the counter, the current record and what the caller has seen
_FLOOR = """
local function floor(cur, seen)
  local g = math.max(tonumber(redis.call('GET', KEYS[1]) or '0') or 0, tonumber(seen) or 0)
  if cur then
    local ok, d = pcall(cjson.decode, cur)
    if ok and type(d) == 'table' then g = math.max(g, tonumber(d.generation) or 0) end
  end
  return g
end
local function put(name, version, g, at, by, op)
  redis.call('SET', KEYS[1], g)
  local v = cjson.encode({name=name, version=version, generation=g, at=tonumber(at), by=by, op=op})
  redis.call('SET', KEYS[2], v)
  redis.call('PUBLISH', KEYS[3], v)
  return v
end
"""

# ARGV: name, version, at, by, op, the highest generation the caller has seen
_RECORD = (
    _FLOOR
    + """
local cur = redis.call('GET', KEYS[2])
if cur then  -- already the fleet's model, and not older than what the caller saw: no-op
  local ok, d = pcall(cjson.decode, cur)
  if ok and type(d) == 'table' and d.name == ARGV[1] and d.version == ARGV[2]
     and (tonumber(d.generation) or 0) >= (tonumber(ARGV[6]) or 0) then return cur end
end
return put(ARGV[1], ARGV[2], floor(cur, ARGV[6]) + 1, ARGV[3], ARGV[4], ARGV[5])
"""
)

# ARGV: the caller's record (name, version, generation, at, by, op); put back unless
# Redis holds one at least as new (another replica restored or recorded first)
_RESTORE = (
    _FLOOR
    + """
local cur = redis.call('GET', KEYS[2])
if cur then
  local ok, d = pcall(cjson.decode, cur)
  if ok and type(d) == 'table' and (tonumber(d.generation) or 0) >= tonumber(ARGV[3]) then
    return cur
  end
end
local g = math.max(floor(cur, ARGV[3]), tonumber(ARGV[3]))
return put(ARGV[1], ARGV[2], g, ARGV[4], ARGV[5], ARGV[6])
"""
)


@dataclass(frozen=True)
class Desired:
    name: str
    version: str
    generation: int
    at: float
    by: str
    op: str = field(default="", compare=False)  # which call recorded it (read back after a stall)

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
                str(d.get("op") or ""),
            )
        except (TypeError, ValueError, KeyError, AttributeError, json.JSONDecodeError) as e:
            raise StoreUnavailable(
                f"fleet state (redis) holds an unreadable desired record: {raw!r:.80}"
            ) from e
        return out

    def ref(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("op")
        return {"id": d.pop("name"), **d}

    def same_model(self, other: Desired | None) -> bool:
        return other is not None and (self.name, self.version) == (other.name, other.version)


def new_op() -> str:
    return secrets.token_hex(8)


@dataclass
class Members:
    """What the index says of the replicas: those beating, those that went silent without
    leaving (ids), and entries whose heartbeat cannot be read."""

    live: list[dict[str, Any]]
    missing: list[str]
    unreadable: int = 0


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

    def _call(self, fn, *args, **kw):
        with unavailable("fleet state"):
            return fn(*args, **kw)

    def _eval(self, script: str, args: list[Any]) -> Desired:
        """EVAL, not EVALSHA: one command whatever Redis's script cache holds (empty after
        a restart), so a record sent into a stalled Redis lands or not as a whole."""
        keys = [self.k_generation, self.k_desired, self.channel]
        return Desired.parse(self._call(self.client.eval, script, len(keys), *keys, *args))

    def desired(self) -> Desired | None:
        raw = self._call(self.client.get, self.k_desired)
        if raw is not None and not isinstance(raw, bytes):
            raise StoreUnavailable(f"fleet state (redis) answered garbage: GET {describe(raw)}")
        return None if raw is None else Desired.parse(raw)

    def record(self, name: str, version: str, by: str, seen: int = 0, op: str = "") -> Desired:
        """Record ``name``/``version`` as the fleet's model, above generation ``seen``;
        -> the record Redis holds now (the current one when it is that model already)."""
        return self._eval(_RECORD, [name, version, time.time(), by, op or new_op(), seen])

    def restore(self, desired: Desired) -> Desired:
        """Put ``desired`` back unless Redis holds a record at least as new; -> what it holds."""
        d = desired
        return self._eval(_RESTORE, [d.name, d.version, d.generation, d.at, d.by, d.op])

    def heartbeat(self, replica_id: str, state: dict[str, Any], ttl: float) -> None:
        now = time.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.k_replica + replica_id, json.dumps(state), px=int(ttl * 1000))
        pipe.zadd(self.k_index, {replica_id: now + ttl})
        pipe.zremrangebyscore(self.k_index, "-inf", now - FORGET_TTLS * ttl)  # long silent
        self._call(pipe.execute)

    def leave(self, replica_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.k_replica + replica_id)
        pipe.zrem(self.k_index, replica_id)
        self._call(pipe.execute)

    def members(self) -> Members:
        now = time.time()
        pairs = self._call(self.client.zrange, self.k_index, 0, -1, withscores=True)
        if not isinstance(pairs, list) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], bytes) for p in pairs
        ):
            raise StoreUnavailable(
                f"fleet state (redis) answered garbage: ZRANGE {describe(pairs)}"
            )
        ids = [p[0].decode("utf-8", "replace") for p in pairs]
        silent = {i for i, (_, expiry) in zip(ids, pairs, strict=True) if float(expiry) <= now}
        if not ids:
            return Members([], [])
        raws = self._call(self.client.mget, [self.k_replica + i for i in ids])
        if not isinstance(raws, list) or len(raws) != len(ids):
            raise StoreUnavailable(f"fleet state (redis) answered garbage: MGET {describe(raws)}")
        out, missing, unreadable = [], sorted(silent), 0
        for rid, raw in zip(ids, raws, strict=True):
            if rid in silent:
                continue
            if raw is None:  # expired between the two calls: silent now
                missing.append(rid)
                continue
            try:  # what GET /v1/models may show: a stray or foreign entry is counted, not shown
                beat = ReplicaOut.model_validate_json(raw).model_dump()
            except (ValidationError, TypeError, ValueError):
                log.debug("fleet: unreadable heartbeat of %r: %r", rid, raw[:200])
                unreadable += 1
                continue
            out.append(beat)
        return Members(sorted(out, key=lambda b: str(b["id"])), sorted(missing), unreadable)

    def replicas(self) -> list[dict[str, Any]]:
        """The replicas beating now (their heartbeats)."""
        return self.members().live

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
