"""The Ray run: a Ray Data actor pool where each actor (``ShardEmbedder``) loads the
model once and then embeds and writes one shard per call. Shards are written by the
actors, not the driver: on a cluster ``--out`` is shared storage and no vector travels
through the driver. Ray is imported here only, inside the functions (the ``bulk`` extra).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from elmo_service.bulk.plan import SKIPPED_FILE, BulkOptions, Shard
from elmo_service.bulk.shard import ShardResult, embed_shard, pyarrow
from elmo_service.errors import ConfigError, ElmoServiceError, InputError


def ray_deps() -> Any:
    """The ``ray`` module (pyarrow checked too), or a ConfigError saying how to install it."""
    # Ray Data logs each execution at INFO; our bar and summary say it (an explicit choice wins)
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
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
    """A Ray Data actor: loads the ``Embedder`` once, then embeds and writes one shard
    per call (``batch_size=1``); returns the shard's result, never its vectors."""

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

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        results = [
            embed_shard(self.emb, Shard.from_json(s), self.opts, self.out, self.spec, self.skip_bad)
            for s in batch["shard"]
        ]
        return {"result": [json.dumps(asdict(r)) for r in results]}


def run_on_ray(
    pending: list[Shard],
    out: Path,
    model: Path,
    version: str,
    opts: BulkOptions,
    spec: Any | None,
    actors: int | None,
    threads: int,
    address: str | None,
    skip_bad: bool,
    progress: bool,
) -> list[ShardResult]:
    """Embed ``pending`` on a Ray Data actor pool; the shards' results."""
    from tqdm import tqdm

    ray = ray_deps()
    started = False
    if not ray.is_initialized():
        if address is None:  # a local cluster: no set-up, gone when the run ends
            cpus = actors * threads if actors else (os.cpu_count() or 1)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
            )
        else:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        started = True
    try:
        if actors is None:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours counts sentences
        ctx.print_on_execution_start = False
        # start only once every actor has loaded its model, so none takes the others' share
        ctx.wait_for_min_actors_s = 600
        ds = ray.data.from_items(
            [{"shard": s.to_json()} for s in pending], override_num_blocks=len(pending)
        ).map_batches(
            ShardEmbedder,
            fn_constructor_kwargs={
                "model": str(model),
                "version": version,
                "opts": asdict(opts),
                "out": str(out),
                "skip_bad": skip_bad,
                "threads": threads,
                "spec": None if spec is None else asdict(spec),
            },
            # a shard is seconds of work: hand it to an actor only when that one is free
            compute=ray.data.ActorPoolStrategy(
                size=min(actors, len(pending)), max_tasks_in_flight_per_actor=1
            ),
            batch_size=1,
            num_cpus=threads,
        )
        tokens, results = 0, []
        total = sum(s.n for s in pending)
        with tqdm(total=total, desc="embed", unit="sent", disable=not progress) as bar:
            for row in ds.iter_rows():
                r = ShardResult(**json.loads(row["result"]))
                if r.model_fault:
                    raise ElmoServiceError(f"{r.error}: a broken model", field="model")
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
        return results
    finally:
        if started:
            ray.shutdown()
