"""Never slower than plain torch: the native biLSTM or the model's own torch code, chosen per
machine by measuring both, once; and the faster library for the batched recurrent product.

    route = calibrated_route(cpu_bilm)
    # {"one": "native" | "torch", "batch": ..., "recurrent_rows": n}

The native kernels' constants (``tuning.py``) were measured on one CPU (an AMD EPYC
with AVX-512). On another the step loops may lose to the model's own torch code
(``TorchBiLM``) for some batch sizes. At warm-up (``CpuBiLM.warm_up``), an fp32 model
big enough for it to matter (:data:`MIN_CELL_ELEMENTS`) times both on a sentence alone
("one") and on a batch of 8 ("batch"), interleaved, median of :data:`REPS`, and
routes each regime to the faster. Both compute the same function (held to one
reference, ``tests/elmo_service/test_every_path.py``), so the route changes speed,
not answers beyond float32 summation order.

Before that, the batched step's recurrent product ``h W_hh^T`` is timed on oneDNN's
packed weight and on MKL with ``W_hh^T`` (which the single-row loop holds anyway) at
:data:`RECURRENT_ROWS`, on the thread count a step runs with: ``recurrent_rows`` is
where oneDNN starts to win for good (steps of fewer rows run on MKL). On the AMD EPYC
oneDNN won from 4 rows; on an Intel Xeon (Sapphire/Emerald Rapids) MKL won 1.15-1.4x up
to 256 rows (docs/bench-embedder.md).

The choice is cached per machine and model shape (CPU model, ISA flags, torch
version, threads, the biLSTM's shape) in ``$ELMO_KERNEL_CACHE`` or
``$XDG_CACHE_HOME/elmo-service/kernel-route.json`` (``~/.cache/...``), so only a
machine's first load of a shape pays (a few seconds for the original ELMo on a quiet machine). Unwritable: kept
in memory for the process. ``ELMO_KERNEL_CALIBRATION=off`` turns it off (native always,
oneDNN for the batched product; the test suite does, for repeatable kernel paths).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elmo_service.atomic import write_text
from elmo_service.bilm.kernels.bilstm import direction_pool
from elmo_service.bilm.kernels.packed import EVERY_STEP

log = logging.getLogger(__name__)

# models smaller than this (lstm_dim x projection_dim) run native without measuring:
# test-sized models, where a few ms of noise would decide
MIN_CELL_ELEMENTS = 1 << 17
REPS = 3
ONE_TOKENS, BATCH_ROWS = 12, 8
# the batched recurrent product's rows measured (a step's rows: up to a batch's sentences)
RECURRENT_ROWS = (2, 8, 32, 128, 256)
ROUTE_KEYS = {"one", "batch", "recurrent_rows"}
_lock = threading.Lock()
_memory: dict[str, dict[str, Any]] = {}


def enabled() -> bool:
    return os.environ.get("ELMO_KERNEL_CALIBRATION", "on").lower() not in ("off", "0", "false")


def cache_file() -> Path:
    given = os.environ.get("ELMO_KERNEL_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elmo-service" / "kernel-route.json"


def machine_key(bilm) -> str:
    """CPU model + ISA flags + torch + threads + the biLSTM's shape."""
    model, flags = "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
                flags = "+".join(f for f in wanted if f in value.split())
    except OSError:
        pass
    cfg = bilm.cfg
    shape = f"{cfg.lstm_dim}/{cfg.projection_dim}x{cfg.n_layers}"
    return f"{model}|{flags}|torch {torch.__version__}|{torch.get_num_threads()}t|{shape}"


def _read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def calibrated_route(kernel: Any) -> dict[str, Any]:
    # kernel: a CpuBiLM (not imported: cpu_bilm imports this module)
    """The regime -> kernel route for ``kernel``'s model on this machine (measured once)."""
    bilm = kernel.bilm
    if not enabled() or bilm.cfg.lstm_dim * bilm.cfg.projection_dim < MIN_CELL_ELEMENTS:
        return {}
    key = machine_key(bilm)
    with _lock:
        if key in _memory:
            return _memory[key]
        stored = _read().get(key)
        if isinstance(stored, dict) and set(stored) == ROUTE_KEYS:
            _memory[key] = stored
            return stored
        route = _measure(kernel)
        _memory[key] = route
        try:
            known = _read()
            known[key] = route
            path = cache_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text(path, json.dumps(known, indent=1, sort_keys=True))
        except OSError as e:
            log.info("kernel route not cached (%s): measured again by the next process", e)
        log.info("kernel route on this machine: %s (%s)", route, key)
        return route


def _measure(kernel: Any) -> dict[str, Any]:
    """The recurrent product's library, then the native and torch biLSTM per regime (median
    seconds, interleaved), the native one with that library."""
    rows = _measure_recurrent(kernel)
    kernel.recurrent_rows = rows
    return {**_measure_regimes(kernel), "recurrent_rows": rows}


def _medians(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds of each run: a first call each (packing, the allocator), then
    :data:`REPS` calls each, interleaved."""
    for f in runs.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPS):
        for name, f in runs.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _measure_recurrent(kernel: Any) -> int:
    """Rows from which oneDNN multiplies by ``W_hh`` faster than MKL on ``W_hh^T`` at every
    larger count measured (a step's product, on the thread count a step runs with)."""
    w_hh = kernel.bilstm_kernel().layers[0][0].w_hh  # one direction of the first layer
    g = torch.Generator().manual_seed(0)

    def product(below: int, h: torch.Tensor, add: torch.Tensor) -> Callable[[], object]:
        def run() -> object:
            w_hh.transposed_below = below  # 0: oneDNN; more than the rows: W^T
            return w_hh(h, add=add)

        return run

    def medians() -> list[dict[str, float]]:
        out = []
        with torch.inference_mode():
            for n in RECURRENT_ROWS:
                h, add = torch.randn(n, w_hh.k, generator=g), torch.randn(n, w_hh.n, generator=g)
                out.append(_medians({"onednn": product(0, h, add), "wt": product(n + 1, h, add)}))
        return out

    pool, before = direction_pool(), w_hh.transposed_below  # a step's directions run there
    try:
        timed = medians() if pool is None else pool.submit(medians).result()
    finally:
        w_hh.transposed_below = before
    rows = EVERY_STEP  # MKL won at the most rows measured: for every step
    for n, med in reversed(list(zip(RECURRENT_ROWS, timed, strict=True))):
        if med["onednn"] > med["wt"]:
            break
        rows = n
    return rows


def _measure_regimes(kernel: Any) -> dict[str, str]:
    """Median seconds of the native and torch biLSTM per regime, interleaved."""
    bilm = kernel.bilm
    p = bilm.cfg.projection_dim
    g = torch.Generator().manual_seed(0)
    one = (torch.randn(1, ONE_TOKENS, p, generator=g), torch.tensor([ONE_TOKENS]))
    lengths = torch.randint(ONE_TOKENS // 2, ONE_TOKENS + 1, (BATCH_ROWS,), generator=g)
    lengths[0] = ONE_TOKENS
    batch = (torch.randn(BATCH_ROWS, ONE_TOKENS, p, generator=g), lengths)
    route = {}
    with torch.inference_mode():
        for regime, (x, n) in (("one", one), ("batch", batch)):
            med = _medians(
                {
                    "native": lambda x=x, n=n: kernel.native_contextualize(x, n),
                    "torch": lambda x=x, n=n: bilm.contextualize(x, n),
                }
            )
            route[regime] = "torch" if med["torch"] < med["native"] else "native"
    return route
