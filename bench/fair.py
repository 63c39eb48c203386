"""What every side-by-side bench shares: the machine header, and each side in its own process.

    header(threads) -> lines: CPU model, ISA (AVX2 / AVX-512 / AVX512_BF16 / AMX), torch, load
    with Side("rival", "bench.bench_latency:AllenSide", threads=2, **kw) as a: a.call("run", ...)

Fairness: a rival (AllenNLP) runs in a process of its own, with its own
defaults, as ``pip install allennlp`` gives them: no OpenMP / MKL variable of ours
(every ``OMP_*``, ``GOMP_*``, ``KMP_*``, ``MKL_*`` is dropped from its environment), and
the thread count set the way its users set it, ``torch.set_num_threads(n)``, the same
``n`` as ours. Ours runs in another process as the README tells a user:
``configure_process("library", threads=n)`` before torch loads. The parent only plans
and times: it alternates the sides round by round (only one runs at a time) and waits
a moment between them, so that one side's idle OpenMP threads have stopped spinning
before the other starts.

Protocol: the worker (``python bench/fair.py --worker``) builds ``factory(**kwargs)``
and answers JSON lines ``{"op": name, "kwargs": {...}}`` with ``{"ok": value}`` or
``{"error": text}``, calling ``getattr(obj, op)(**kwargs)``. Its stdout is kept for the
protocol (anything a library prints goes to stderr).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the variables that tune OpenMP / MKL: never passed to a side (ours sets its own)
TUNING_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "ELMO_THREADS")
PAUSE_S = 0.3  # between sides: libgomp's default spin (~300k turns) is long over by then


# -- the header ---------------------------------------------------------------------
def cpu_model() -> str:
    """The model name, with its family and model numbers (a name like "AMD EPYC" alone
    does not tell one generation from another)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa(flags: set[str] | None = None) -> str:
    """The vector ISA that matters to the kernels: "AVX2", "AVX-512", "AVX-512 +BF16",
    "AVX-512 +BF16 +AMX" (or "other")."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" not in flags:
        return "AVX2" if "avx2" in flags else "other"
    out = "AVX-512"
    if "avx512_bf16" in flags:
        out += " +BF16"
    if "amx_tile" in flags:
        out += " +AMX"
    return out


def header(threads: int) -> list[str]:
    """The lines every bench prints first: what ran, where, under what load."""
    import torch  # noqa: PLC0415 - the parent may not need torch otherwise

    load = os.getloadavg()
    loaded = " (measured under load from parallel work)" if load[0] > 2 else ""
    return [
        f"CPU: {cpu_model()}, ISA {isa()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{threads} threads per side",
        f"load average at start {load[0]:.2f} (1 min) / {load[1]:.2f} (5 min){loaded}",
    ]


def footer() -> str:
    load = os.getloadavg()
    return f"load average at end {load[0]:.2f} (1 min) / {load[1]:.2f} (5 min)"


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of process ``pid`` (all its threads), or of its thread ``tid``."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- a side in its own process ------------------------------------------------------
def clean_env() -> dict[str, str]:
    """The parent's environment without any OpenMP / MKL / thread tuning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(TUNING_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Side:
    """One side of a comparison, in a worker process.

    role : ``"rival"`` (its defaults; ``torch.set_num_threads(threads)``) or ``"ours"``
        (``configure_process("library", threads)``, as the README says).
    factory : ``"module:callable"``, imported in the worker after the role's setup.
    """

    def __init__(
        self, role: str, factory: str, threads: int, env: dict | None = None, **kwargs: Any
    ) -> None:
        """``env``: variables added to the side's clean environment (a rival run off its
        defaults on purpose, e.g. ``OMP_WAIT_POLICY=PASSIVE``, labelled as such)."""
        assert role in ("rival", "ours")
        self.role, self.factory = role, factory
        spec = json.dumps({"role": role, "factory": factory, "threads": threads, "kwargs": kwargs})
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**clean_env(), **(env or {})},
            text=True,
        )  # fmt: skip
        assert self.proc.stdin
        self.proc.stdin.write(spec + "\n")  # the first line: what to build (may be long)
        self.call("_ready")

    def call(self, op: str, **kwargs: Any) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.factory} ({self.role}) ended (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.factory}.{op}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
                self.call("_quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alternate(sides: dict[str, Side], op: str, rounds: int, **kwargs: Any) -> dict[str, list]:
    """``op`` on every side, ``rounds`` times, one side at a time, the order rotated each
    round, :data:`PAUSE_S` between sides: each side's answers, per round."""
    names = list(sides)
    out: dict[str, list] = {n: [] for n in names}
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            time.sleep(PAUSE_S)
            out[name].append(sides[name].call(op, **kwargs))
    return out


class EnvProbe:
    """A side that reports what its process sees (the bench's fairness, checked by
    ``tests/test_bench_fair.py``): its OpenMP / MKL variables and torch's thread count."""

    def report(self) -> dict:
        import torch

        tuning = {k: v for k, v in os.environ.items() if k.startswith(TUNING_PREFIXES)}
        return {"tuning_env": tuning, "threads": torch.get_num_threads()}


# -- the worker ---------------------------------------------------------------------
def _worker() -> None:
    spec = json.loads(sys.stdin.readline())
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    threads = int(spec["threads"])
    if spec["role"] == "ours":
        from elmo_service import configure_process

        configure_process("library", threads)  # as the README tells a user, before torch
    else:
        import torch

        torch.set_num_threads(threads)  # as an AllenNLP user sets it; nothing else
    module, name = spec["factory"].split(":")
    obj = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "_quit":
                proto.write(json.dumps({"ok": None}) + "\n")
                proto.flush()
                return
            value = None if op == "_ready" else getattr(obj, op)(**msg["kwargs"])
            reply = {"ok": value}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.path.insert(0, str(ROOT))
    _worker()
