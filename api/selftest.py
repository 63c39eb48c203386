"""The served model's self-test: the artifact's stored sentences, run alone and batched.

``elmo_service.selftest`` stores fixed sentences and their vectors with an artifact at
export; :func:`run_selftest` runs the served model on them through its runner (the one
model thread; each sentence alone, then all in one request: the batcher may plan them
into one batch or several, as it does any request), bypassing the vector cache, and
compares every value with the bound (``1e-5 x max(1, |stored|)``). The result is kept on
the served model: ``/readyz`` can require a pass (``ELMO_READY_REQUIRES_SELFTEST``), and
the fleet view shows each replica's (:func:`summary`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from elmo_api.admission import BatcherClosed, QueueFull
from elmo_api.served import ModelTimeout, ServedModel
from elmo_service.errors import ArtifactError
from elmo_service.selftest import REL_BOUND, compare, load_selftest

BOUND_RULE = "|served - stored| <= 1e-5 x max(1, |stored|), every value"


def _exact(served: ServedModel) -> bool:
    """The bound is fp32's: bf16 / fp16 autocast and int8 weights are only reported."""
    emb = served.embedder
    return getattr(emb, "precision", "fp32") == "fp32" and getattr(emb, "weights", "fp32") == "fp32"


async def run_selftest(served: ServedModel) -> dict[str, Any]:
    """Run the self-test now; the result is also left in ``served.selftest``. The runner's
    refusals (QueueFull, ModelTimeout, BatcherClosed) propagate: nothing is kept then."""
    t0 = time.perf_counter()
    base: dict[str, Any] = {
        "model": {"id": served.name, "version": served.version},
        "bound": {"relative": REL_BOUND, "rule": BOUND_RULE},
        "checked_at": time.time(),
    }
    loop = asyncio.get_running_loop()
    try:
        stored = await loop.run_in_executor(served.io, load_selftest, served.path)
    except ArtifactError as e:
        result = {**base, "status": "error", "ok": False, "error": e.message}
        served.selftest = result
        return result
    if stored is None:
        result = {
            **base,
            "status": "absent",
            "ok": None,
            "error": "this artifact stores no self-test (exported before it existed: "
            "python -m elmo_service.selftest MODEL_DIR writes one)",
        }
        served.selftest = result
        return result
    timeout = max(served.request_timeout, 60.0)
    alone = []
    try:
        for toks in stored.tokens:
            alone += await served.runner.embed([toks], timeout=timeout)
        batched = await served.runner.embed(stored.tokens, timeout=timeout)
    except TimeoutError as e:  # answered by api/errors.py's table, as an embed's would be
        raise ModelTimeout(f"the self-test timed out after {timeout:g}s; retry later") from e
    a, b = compare(stored.vectors, alone), compare(stored.vectors, batched)
    exact = _exact(served)
    passed = a["within_bound"] and b["within_bound"]
    result = {
        **base,
        "status": ("passed" if passed else "failed") if exact else "unchecked",
        "ok": passed if exact else None,
        "sentences": len(stored.tokens),
        "max_abs_diff": max(a["max_abs_diff"], b["max_abs_diff"]),
        "max_rel_diff": max(a["max_rel_diff"], b["max_rel_diff"]),
        "alone": a,
        "batched": b,
        "stored_for_version": stored.meta.get("model_version"),
        "exact": exact,
        "seconds": time.perf_counter() - t0,
    }
    if not exact:
        result["error"] = "the bound applies to fp32 serving; this replica serves " + (
            f"precision {served.embedder.precision}, weights {served.embedder.weights}"
        )
    served.selftest = result
    return result


async def ensure_selftest(served: ServedModel) -> dict[str, Any]:
    """The served model's self-test result, run once (concurrent callers share the run).
    A run the model could not take now (overloaded, timed out, shutting down) is answered as
    an error and not kept: the next call tries again."""
    if served.selftest is not None:
        return served.selftest
    task = served.selftest_run
    if task is None:
        task = served.selftest_run = asyncio.ensure_future(run_selftest(served))
    try:
        return await asyncio.shield(task)
    except (QueueFull, ModelTimeout, BatcherClosed) as e:
        return {
            "model": {"id": served.name, "version": served.version},
            "status": "error",
            "ok": False,
            "error": f"could not run now ({type(e).__name__}: {e}); retried on the next call",
            "checked_at": time.time(),
        }
    finally:
        if task.done():
            served.selftest_run = None


def summary(served: ServedModel | None) -> dict[str, Any] | None:
    """What the fleet view shows of a replica's self-test (None: not run)."""
    return summarize(None if served is None else served.selftest)


def summarize(r: dict[str, Any] | None) -> dict[str, Any] | None:
    """A self-test result, short."""
    if r is None:
        return None
    return {
        "status": r["status"],
        "ok": r["ok"],
        "max_rel_diff": r.get("max_rel_diff"),
        "checked_at": r["checked_at"],
    }
