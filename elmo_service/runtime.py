"""Device, thread and precision choices, made once per process.

Shared by the embedder and the trainer so both pick devices and autocast the
same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from elmo_service.bilm.config import PRECISIONS
from elmo_service.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


def pick_device(device: str | torch.device | None = "auto") -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available", field="device")
    return dev


def set_threads(threads: int | None) -> int:
    """Give this process an explicit intra-op thread count.

    OpenMP spinning across two threads collapses when another process shares
    the cores, so an explicit count (default: ELMO_THREADS, else all cores)
    is set rather than left to the runtime.
    """
    if threads is None:
        env = os.environ.get("ELMO_THREADS")
        if env and not env.strip().isdigit():
            raise ConfigError(f"ELMO_THREADS must be a whole number, got {env!r}", field="threads")
        threads = int(env) if env else (os.cpu_count() or 1)
    if threads < 1:
        raise ConfigError("threads must be >= 1", field="threads")
    torch.set_num_threads(threads)
    return threads


def in_transient_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends with it; its result or exception.

    For loading a model in a process whose model then runs on another thread
    (a server's batcher). OpenMP (libgomp) gives every thread that runs a
    parallel torch op a pool of worker threads for as long as that thread
    lives; once the process holds more of them than cores, libgomp cuts its
    spin-wait to ~100 spins and every parallel op of the model's thread pays a
    sleep and a wake-up (measured on 2 cores: batch-1 calls 10.1 -> 12.0 ms,
    ~170 context switches a call). A thread that ends takes its pool with it.
    """
    thread, done = _start_transient(fn, args, kwargs)
    thread.join()
    return done.result()


async def in_transient_thread_async(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """:func:`in_transient_thread` for an event loop: awaits the thread instead of joining it."""
    _, done = _start_transient(fn, args, kwargs)
    return await asyncio.wrap_future(done)


def _start_transient(
    fn: Callable[..., T], args: tuple, kwargs: dict
) -> tuple[threading.Thread, concurrent.futures.Future[T]]:
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:  # re-raised on the caller's side
            done.set_exception(e)

    thread = threading.Thread(target=run, name="elmo-load", daemon=True)
    thread.start()
    return thread, done


def start_thread(target: Callable[[], None], name: str, threads: int) -> threading.Thread:
    """Start a daemon thread with ``threads`` intra-op (torch) threads of its own, leaving
    the caller's count and torch's default for later threads as they were (a server's
    express thread: one intra-op thread keeps it beside the main thread within the cores)."""
    pinned = threading.Event()

    def run() -> None:
        # torch sets a thread's count from its default on the thread's first parallel op:
        # take that first, or it would undo the count set here
        torch.get_num_threads()
        torch.set_num_threads(threads)
        pinned.set()
        target()

    default = torch.get_num_threads()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    pinned.wait(10)
    # torch also records the last count set as the default of threads started later
    torch.set_num_threads(default)
    return thread


def renice(threads: list[threading.Thread], nice: int) -> None:
    """Make ``threads`` at least ``nice`` (Linux: niceness is per thread; raising it needs
    no privilege, lowering it does, so a thread already nicer stays as it is)."""
    for t in threads:
        try:
            tid = t.native_id
            if tid is not None and os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError) as e:  # not Linux, or not allowed
            log.warning("cannot lower the priority of thread %s: %s", t.name, e)
            return


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in hardware rather than emulating it.

    CPUs without AVX-512 (or AMX) convert every bf16 op through fp32 and run
    bf16 autocast several times slower than plain fp32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _check_concrete(device: torch.device, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}", field="precision")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("fp16 autocast needs CUDA; use bf16 on CPU", field="precision")


def resolve_precision(device: torch.device, precision: str) -> str:
    """``precision`` made concrete for ``device``: ``auto`` is bf16 where native, else fp32.

    An explicit bf16 on a CPU that would emulate it is kept (numerics are the
    caller's choice) but logged, because it is the slow path.
    """
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    _check_concrete(device, precision)
    if precision == "bf16" and not native_bf16(device):
        log.warning(
            "bf16 requested but this %s has no native bf16 (no AVX-512/AMX): it is emulated "
            "and usually slower than fp32; precision 'auto' picks fp32 here",
            device.type,
        )
    return precision


def autocast(device: torch.device, precision: str):
    """Autocast context for a resolved ``precision`` on ``device`` (a no-op for fp32)."""
    if precision == "auto":
        raise ConfigError("resolve precision 'auto' first (resolve_precision)", field="precision")
    _check_concrete(device, precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
