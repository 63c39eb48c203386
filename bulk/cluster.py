"""The Ray run: a pool of Ray actors where each (``ShardEmbedder``) loads the model once
and then embeds and writes one shard per call, handed the next shard when it is free. Shards are written by the
actors, not the driver: on a cluster ``--out`` is shared storage and no vector travels
through the driver. Ray is imported here only, inside the functions (the ``bulk`` extra).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elmo_bulk.plan import SKIPPED_FILE, BulkOptions, Shard
from elmo_bulk.reaper import ENV as MARKER_ENV
from elmo_bulk.shard import ShardResult, embed_shard, pyarrow
from elmo_service.errors import ConfigError, ElmoServiceError, InputError

# Ray's node IP is loopback when this is "0" (read when Ray is imported, and by each Ray
# process it starts): every server of a local cluster then listens on 127.0.0.1 only.
# ray.init(_node_ip_address="127.0.0.1") does not do it (Ray 2.60 resolves it to the
# host's address, and its gRPC servers listen on every interface).
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_deps(local: bool = False) -> Any:
    """The ``ray`` module (pyarrow checked too), or a ConfigError saying how to install it.
    ``local``: a local cluster will be started, bound to loopback (set before Ray loads)."""
    if local:
        os.environ[LOOPBACK_ONLY] = "0"
    pyarrow()
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"embed-bulk needs Ray Data and pyarrow ({e.name} is missing): "
            "pip install 'elmo-service[bulk]'",
            field="embed-bulk",
        ) from e
    return ray


class ShardEmbedder:
    """A Ray actor: loads the ``Embedder`` once, then embeds and writes one shard per
    ``embed`` call; returns the shard's result (JSON), never its vectors."""

    def __init__(
        self,
        model: str,
        version: str,
        opts: dict,
        out: str,
        skip_bad: bool,
        threads: int,
        spec: dict | None,
    ) -> None:
        from elmo_service.embedder import Embedder
        from elmo_service.scalar_mix import MixSpec

        self.opts = BulkOptions(**opts)
        self.emb = Embedder.load(
            model, threads=threads, device="cpu", batch_tokens=self.opts.batch_tokens
        )
        if self.emb.version != version:
            raise ConfigError(
                f"model {model} is version {self.emb.version} here, {version} on the driver: "
                "every node must see the same model files",
                field="model",
            )
        self.out = Path(out)
        self.skip_bad = skip_bad
        self.spec = None if spec is None else MixSpec(**spec)

    def ready(self) -> bool:
        """The model is loaded (the constructor has run)."""
        return True

    def embed(self, shard: dict) -> str:
        r = embed_shard(
            self.emb, Shard.from_json(shard), self.opts, self.out, self.spec, self.skip_bad
        )
        return json.dumps(asdict(r))


def actor_start_error(e: Exception) -> ElmoServiceError:
    """An actor whose constructor raised (the model missing or another version on a node)
    as one line: Ray passes only the remote traceback's text, whose last line is ours."""
    text = getattr(e, "error_msg", None) or str(e)
    last = next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")
    m = re.match(r"elmo_service\.errors\.\w+: (.+)", last)
    if m:
        return ConfigError(m.group(1), field="model")
    return ElmoServiceError(f"a model actor did not start: {last}", field="model")


# Ray's driver logs one line per actor from C++ straight to fd 2: "core_worker.cc: ...
# has constructor arguments in the object store and max_restarts > 0"
# (ray-project/ray#53727): harmless here (the arguments live as long as the run).
# No option turns off that one line (RAY_BACKEND_LOG_LEVEL prints a line of its own).
HARMLESS = re.compile(rb"core_worker\.cc:\d+: .*constructor arguments in the object store")


@contextmanager
def harmless_lines_hidden() -> Iterator[None]:
    """fd 2 through a filter that drops ``HARMLESS`` lines and passes the rest on at once."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([read], [], [], 0.1)
            chunk = os.read(read, 65536) if ready else b""
            if ready and not chunk:  # EOF: every writer is gone
                os.write(saved, pending)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = b"".join(x + b"\n" for x in lines if not HARMLESS.search(x))
            # a partial line: a bar's, passed on now; one that may be a log line ("[date
            # ...", written whole by Ray), once the pipe has been quiet for 0.1 s
            if pending and (not chunk or not pending.startswith(b"[")):
                kept, pending = kept + pending, b""
            if kept:
                os.write(saved, kept)

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer here is gone: the pump drains and ends
        thread.join(timeout=5)
        if not thread.is_alive():  # else a stray writer holds the pipe: the pump keeps both
            os.close(read)
            os.close(saved)


@contextmanager
def ray_session(ray: Any, address: str | None, cpus: int | None) -> Iterator[None]:
    """Ray for one run: the caller's if already started; else ``address``'s; else a local
    cluster of all CPUs (more if ``cpus`` asks) on loopback only, with a reaper that ends
    every process of it when this process ends, however it ends."""
    if ray.is_initialized():
        yield
        return
    if address is not None:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        try:
            yield
        finally:
            ray.shutdown()
        return
    # an earlier import of Ray read the switch already: it is read again here
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    marker = uuid.uuid4().hex
    read, write = os.pipe()
    reaper = subprocess.Popen(
        [sys.executable, "-m", "elmo_bulk.reaper", marker],
        stdin=read,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives a kill of this process's group
    )
    os.close(read)
    os.environ[MARKER_ENV] = marker  # every Ray process inherits it
    try:
        ray.init(
            num_cpus=max(cpus or 1, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=True,
        )
        ip = ray.util.get_node_ip_address()
        if ip not in ("127.0.0.1", "::1"):  # fail closed: no cluster open to the network
            raise ConfigError(
                f"the local Ray cluster would listen on {ip}, not loopback only: "
                f"run embed-bulk in a fresh process, or start a cluster and give --address",
                field="address",
            )
        yield
    finally:
        ray.shutdown()
        os.environ.pop(MARKER_ENV, None)
        os.close(write)  # the reaper ends whatever is left, then exits
        reaper.wait(timeout=60)


def pool_shape(cpus: int, actors: int | None, threads: int | None) -> tuple[int, int]:
    """(actors, threads per actor) within the cluster's CPUs: threads from the CPUs left to
    each of ``actors``, else one; actors as many as fit. Each actor reserves its threads'
    CPUs, so the biLSTM's two direction workers (2 or 3 threads) never share a core with
    another actor's."""
    if threads is None:
        threads = max(1, cpus // actors) if actors else 1
    return actors or max(1, cpus // threads), threads


def run_on_ray(
    pending: list[Shard],
    out: Path,
    model: Path,
    version: str,
    opts: BulkOptions,
    spec: Any | None,
    actors: int | None,
    threads: int | None,
    address: str | None,
    skip_bad: bool,
    progress: bool,
) -> list[ShardResult]:
    """Embed ``pending`` on a Ray Data actor pool; the shards' results."""
    from tqdm import tqdm

    ray = ray_deps(local=address is None)
    cpus = actors * (threads or 1) if actors else None  # at least: the pool must fit
    with harmless_lines_hidden(), ray_session(ray, address, cpus):
        actors, threads = pool_shape(int(ray.cluster_resources().get("CPU", 1)), actors, threads)
        # plain actors, not a Ray Data pool: Ray Data's planning and helper actors cost
        # ~2-3 CPU-seconds a run (docs/bulk.md) and its batching is not used (one shard a
        # call). Like its pool: Ray restarts an actor that dies and retries its shard.
        remote = ray.remote(num_cpus=threads, max_restarts=-1, max_task_retries=-1)
        kwargs = {
            "model": str(model),
            "version": version,
            "opts": asdict(opts),
            "out": str(out),
            "skip_bad": skip_bad,
            "threads": threads,
            "spec": None if spec is None else asdict(spec),
        }
        pool = [remote(ShardEmbedder).remote(**kwargs) for _ in range(min(actors, len(pending)))]
        # start only once every actor has loaded its model, so none takes the others' share
        try:
            ray.get([a.ready.remote() for a in pool])
        except ray.exceptions.RayActorError as e:
            raise actor_start_error(e) from None
        todo, running = deque(pending), {}

        def give(actor: Any) -> None:  # a shard to an actor only when it is free
            if todo:
                running[actor.embed.remote(todo.popleft().to_json())] = actor

        for a in pool:
            give(a)
        tokens, results = 0, []
        total = sum(s.n for s in pending)
        with tqdm(total=total, desc="embed", unit="sent", disable=not progress) as bar:
            while running:
                (done,), _ = ray.wait(list(running), num_returns=1)
                actor = running.pop(done)
                r = ShardResult(**json.loads(ray.get(done)))
                if r.model_fault:
                    raise ElmoServiceError(f"{r.error}: a broken model", field="model")
                if r.write_fault:
                    raise ElmoServiceError(r.error, field="out")
                if r.error is not None:
                    raise InputError(
                        f"{r.error}; fix the line, or --skip-bad to skip such lines "
                        f"(listed in {SKIPPED_FILE})",
                        field="input",
                    )
                results.append(r)
                tokens += r.tokens
                bar.update(r.lines)
                bar.set_postfix(tokens=tokens, refresh=False)
                give(actor)
        return results
