"""Run one job: prepare -> train -> export, each phase an ``elmo-pretrain`` subprocess
(a ``base_model`` job: one ``elmo-pretrain adapt``, which prepares, trains and exports).

Each phase is idempotent, so a re-queued job simply runs again and continues:

* prepare: skipped for an already prepared corpus; ``elmo-pretrain prepare``
  itself does nothing when ``<run>/data`` holds the same preparation;
* train: always ``--resume`` (a fresh run folder starts at step 0, a used one
  continues from its newest checkpoint);
* export: skipped when ``<models_dir>/<name>`` already holds this run's export;
* adapt: ``--resume`` once its work folder (``<run>/adapt``) holds an adaptation.

The trainer runs in its own process so that cancelling is a SIGTERM to it (it
finishes the step, writes a checkpoint and exits 0) and progress is its
``metrics.jsonl``. A phase process killed by a signal we did not send (the
kernel's OOM killer: SIGKILL) re-queues the job like a lost worker: it resumes
from its checkpoint, bounded by ``ELMO_JOBS_MAX_ATTEMPTS``, the reason kept in
``last_loss``. Every record write is fenced by the job's ``attempt``: a
runner whose job was re-queued meanwhile (its heartbeat looked dead) stops
its trainer and leaves the record alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from elmo_jobs.lifecycle import Backend, requeue
from elmo_jobs.procs import child_setup, runner_info
from elmo_jobs.settings import JobsSettings
from elmo_jobs.spec import (
    AdaptIn,
    PrepareIn,
    check_device,
    is_prepared_corpus,
    machine_cores,
    resolve_corpus,
    visible_gpus,
)
from elmo_jobs.state import (
    ArtifactInfo,
    JobRecord,
    Progress,
    StoreUnavailable,
    Unreadable,
    figure,
    name_holder_free,
)
from elmo_pretrain.run_dir import list_checkpoints, metrics_path
from elmo_pretrain.tracking import is_stop

log = logging.getLogger("jobs")

LOG_FILE = "job.log"
TAIL_LINES = 40


class JobFailed(Exception):
    """The job cannot succeed (bad input, a phase failed); the message is the reason."""


class _Cancelled(Exception):
    pass


class _Stopped(Exception):
    """This process was asked to stop (worker shutdown, or the worker died above us)."""


class _Superseded(Exception):
    """The record moved on without us (re-queued or finished elsewhere)."""


class _Killed(Exception):
    """A phase's process was killed by a signal we did not send (e.g. the kernel's OOM
    killer's SIGKILL): the job is retried from its checkpoint, like a lost worker."""


# ---------------------------------------------------------------- reading the run


def tail(path: Path, n: int = TAIL_LINES, max_bytes: int = 32_768) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").replace("\r", "\n").splitlines()
    return [x for x in lines if x.strip()][-n:]


def newest_checkpoint(train_dir: Path) -> str | None:
    found = list_checkpoints(train_dir)
    return found[-1].name if found else None


def numeric(d: dict[str, Any]) -> dict[str, float | None]:
    """The numbers of a held-out result (it also carries labels, e.g. ``protocol``);
    a non-finite one (a diverged run) as None."""
    return {
        k: figure(v) for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


class MetricsReader:
    """Follows ``metrics.jsonl`` (appended across resumes) into a :class:`Progress`;
    ``stop`` is the last stop record read (why a training segment ended)."""

    def __init__(self, path: Path, total_steps: int) -> None:
        self.path, self.pos = path, 0
        self.progress = Progress(total_steps=total_steps)
        self.stop: dict[str, Any] | None = None

    def read(self) -> Progress:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return self.progress
        end = chunk.rfind(b"\n") + 1  # only complete lines
        self.pos += end
        p = self.progress
        for line in chunk[:end].splitlines():
            try:
                self._take(json.loads(line), p)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a line we cannot use never stops progress reporting
        if p.step and p.elapsed_s and p.total_steps:
            p.eta_s = round(p.elapsed_s / p.step * max(0, p.total_steps - p.step), 1)
        return p

    def _take(self, rec: Any, p: Progress) -> None:
        if is_stop(rec):
            self.stop = rec
        elif "heldout" in rec:
            p.heldout = numeric(rec["heldout"])
        elif "loss" in rec:
            p.step, p.epoch = int(rec["step"]), rec.get("epoch")
            p.tokens_seen = int(rec.get("tokens_seen", p.tokens_seen))
            p.loss, p.perplexity = figure(rec.get("loss")), figure(rec.get("ppl"))
            p.tokens_per_s = figure(rec.get("tok_s"))
            p.elapsed_s, p.lr = figure(rec.get("elapsed_s")), figure(rec.get("lr"))


def diverged_reason(stop: dict[str, Any]) -> str:
    """A divergence stop record in words: the trainer's own sentence (which already says
    "training diverged at step N: ..."), or one built from the record when it has none."""
    detail = str(stop.get("detail") or "").strip()
    detail = detail.splitlines()[0] if detail else "non-finite loss"
    if detail.startswith("training diverged"):
        return detail
    return f"training diverged at step {stop.get('step')}: {detail}"


def artifact_info(name: str, dest: Path) -> ArtifactInfo:
    from elmo_service.artifact import read_config, read_manifest

    prov = read_config(dest).get("provenance", {})
    return ArtifactInfo(
        name=name,
        version=read_manifest(dest)["version"],
        path=str(dest),
        step=prov.get("step"),
        tokens_seen=prov.get("tokens_seen"),
        heldout=numeric(prov["heldout"]) if prov.get("heldout") else None,
    )


# ---------------------------------------------------------------- the runner


class JobRunner:
    def __init__(
        self,
        backend: Backend,
        settings: JobsSettings,
        job_id: str,
        attempt: int,
        worker: str | None = None,
    ) -> None:
        self.backend, self.store, self.settings = backend, backend.store, settings
        self.job_id, self.attempt, self.worker = job_id, attempt, worker
        self.parent_pid = os.getppid()
        self._stop_requested = False
        self._cancel = False
        self._last_beat = 0.0
        self.metrics: MetricsReader | None = None
        self.phase: str | None = None

    def request_stop(self) -> None:
        """Signal-safe: the running phase is stopped at the next poll, with a checkpoint."""
        self._stop_requested = True

    # -- record updates (fenced by attempt) ----------------------------------------
    def _mine(self, r: JobRecord) -> bool:
        return r.attempt == self.attempt and r.state == "running"

    def _claim(self) -> JobRecord | None:
        me = runner_info(self.worker)

        def fn(r: JobRecord) -> bool:
            if r.attempt != self.attempt or r.state != "queued":
                return False
            if r.cancel_requested:
                r.finish("cancelled")
                return True
            r.state, r.runner, r.heartbeat_at = "running", me, time.time()
            r.started_at = r.started_at or r.heartbeat_at
            r.note(f"attempt {r.attempt} started on {me.host} (pid {me.pid})")
            return True

        rec, _ = self.store.update(self.job_id, fn)
        if rec is None or rec.state != "running" or rec.runner != me or rec.attempt != self.attempt:
            return None
        return rec

    def _beat(self, force: bool = False) -> None:
        """Heartbeat + progress + log tail; picks up cancel requests. Raises _Superseded."""
        now = time.monotonic()
        # a record write every other poll: progress is fresh, the store is not hammered
        if not force and now - self._last_beat < 2 * self.settings.jobs_poll_interval:
            return
        self._last_beat = now
        progress = self._progress()
        lines = tail(self.log_path)

        def fn(r: JobRecord) -> bool:
            if not self._mine(r):
                return False
            r.heartbeat_at = time.time()
            r.phase = self.phase  # type: ignore[assignment]
            if progress is not None:
                r.progress = progress
            r.log_tail = lines
            return True

        try:
            rec, written = self.store.update(self.job_id, fn)
        except (StoreUnavailable, Unreadable) as e:  # keep training through a store outage
            log.warning("job %s: heartbeat not stored: %s", self.job_id, e)
            return
        if rec is None:  # the store lost it (a Redis restarted empty): we have it
            self._recreate()
            return
        if not written:
            raise _Superseded()
        self.rec = rec
        self._cancel = rec.cancel_requested

    def _recreate(self) -> None:
        """Write back our own copy of a record the store no longer has."""
        rec = self.rec.model_copy(deep=True)
        rec.note("re-created by its runner: the job store had lost the record")
        try:
            if self.store.create_if_absent(rec):
                log.warning("job %s: the job store had lost its record; re-created", self.job_id)
            self.store.reserve(rec.name, rec.id, name_holder_free(self.store))
        except StoreUnavailable as e:
            log.warning("job %s: record not re-created yet: %s", self.job_id, e)

    def _stored(self, write: Callable[[], Any], what: str) -> Any:
        """A final record write (finish, re-queue), retried through a job-store outage for
        up to ``jobs_heartbeat_timeout``: a blip at the end of a job loses nothing. Past
        that the record stays running; the reconciler re-queues it, and the next attempt
        finds the work done (training resumes at its last step, export is skipped)."""
        deadline = time.monotonic() + self.settings.jobs_heartbeat_timeout
        while True:
            try:
                return write()
            except (StoreUnavailable, Unreadable) as e:
                if time.monotonic() > deadline:
                    log.error("job %s: %s not stored, giving up: %s", self.job_id, what, e)
                    return None
                log.warning("job %s: %s not stored yet (%s); retrying", self.job_id, what, e)
                time.sleep(min(2.0, self.settings.jobs_poll_interval * 4))

    def _progress(self) -> Progress | None:
        if self.metrics is None:
            return None
        p = self.metrics.read()
        p.checkpoint = newest_checkpoint(self.train_dir)
        return p.model_copy()

    def _finish(self, state: str, error: str | None = None, **extra: Any) -> JobRecord | None:
        progress = self._progress()
        lines = tail(self.log_path)

        def fn(r: JobRecord) -> bool:
            if not self._mine(r):
                return False
            if progress is not None:
                r.progress = progress
            r.log_tail = lines
            for k, v in extra.items():
                setattr(r, k, v)
            r.finish(state, error)  # type: ignore[arg-type]
            return True

        def write() -> JobRecord | None:
            rec, written = self.store.update(self.job_id, fn)
            if rec is None:  # lost by the store: put ours back, then finish it
                self._recreate()
                rec, written = self.store.update(self.job_id, fn)
            return rec if written else None

        return self._stored(write, f"final state {state!r}")

    def _requeue(self, reason: str, lost: bool) -> None:
        def write() -> JobRecord | None:
            return requeue(self.backend, self.job_id, self.attempt, reason, lost=lost)

        rec = self._stored(write, "re-queue")
        if rec is not None and rec.state == "queued":
            try:
                self.backend.deliver(rec)
            except Exception as e:  # noqa: BLE001 - the reconciler delivers a queued job again
                log.warning("job %s: re-queued but not delivered yet: %s", self.job_id, e)

    # -- the job -----------------------------------------------------------------
    def run(self) -> str:
        """Run the job to its end (or until stopped). Returns what happened."""
        rec = self._claim()
        if rec is None:
            log.info(
                "job %s attempt %d: not claimable (moved on); skipped", self.job_id, self.attempt
            )
            return "skipped"
        self.rec = rec
        self.run_dir = Path(rec.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_dir = self.run_dir / "train"
        self.log_path = self.run_dir / LOG_FILE
        try:
            with self._run_lock() as lock_fd:
                self.lock_fd = lock_fd
                self._say(f"attempt {self.attempt} on {socket.gethostname()} (pid {os.getpid()})")
                if rec.spec.get("base_model"):
                    artifact = self._adapt()
                else:
                    data = self._prepare()
                    self._train(data)
                    artifact = self._export()
            self._say(f"succeeded: model {artifact.name} (version {artifact.version})")
            self._finish("succeeded", artifact=artifact, phase=None)
            return "succeeded"
        except _Cancelled:
            ck = newest_checkpoint(self.train_dir)
            self._say(f"cancelled{f' (checkpoint {ck})' if ck else ''}")
            self._finish("cancelled")
            return "cancelled"
        except _Stopped:
            died = os.getppid() != self.parent_pid
            why = "its worker died" if died else "its worker is shutting down"
            self._say(f"stopped: {why}; re-queued, it resumes from its last checkpoint")
            self._requeue(f"stopped because {why}", lost=died)
            return "requeued"
        except _Superseded:
            log.warning("job %s attempt %d was taken over; stopping", self.job_id, self.attempt)
            return "superseded"
        except _Killed as e:
            self._say(f"{e}; re-queued, it resumes from its last checkpoint")
            self._requeue(str(e), lost=True)
            return "requeued"
        except JobFailed as e:
            self._say(f"failed: {e}")
            self._finish("failed", str(e))
            return "failed"
        except Exception as e:  # a bug or an environment problem: the job fails, visibly
            log.exception("job %s failed", self.job_id)
            self._say(f"failed: {type(e).__name__}: {e}")
            self._finish("failed", f"{type(e).__name__}: {e}")
            return "failed"

    def _say(self, msg: str) -> None:
        with contextlib.suppress(OSError), open(self.log_path, "a") as f:
            f.write(f"[job {time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")

    @contextlib.contextmanager
    def _run_lock(self):
        """One runner per run folder. The trainer inherits the lock, so a replacement
        runner waits here while a stopped predecessor's trainer writes its checkpoint."""
        fd = os.open(self.run_dir / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.settings.jobs_stop_timeout + 30
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise JobFailed("the run folder stays locked by another process") from None
                    self._beat()
                    self._check_stop(None)
                    time.sleep(self.settings.jobs_poll_interval)
            yield fd
        finally:
            os.close(fd)

    # -- phases --------------------------------------------------------------------
    def _prepare(self) -> Path:
        self.phase = "prepare"
        self._beat(force=True)
        spec = self.rec.spec
        corpus = resolve_corpus(self.settings.data_dir, spec["corpus"])  # checked again: files move
        if is_prepared_corpus(corpus):
            self._say(f"corpus {spec['corpus']} is already prepared")
            return corpus
        out = self.run_dir / "data"
        if is_prepared_corpus(out):  # prepare renames its result into place: complete
            self._say("corpus already prepared by an earlier attempt")
            return out
        opts = PrepareIn.model_validate(spec.get("prepare") or {})
        cmd = ["prepare", str(corpus), "--out", str(out), "--no-progress", *opts.cli_args()]
        rc, _ = self._run_phase(cmd)
        if rc != 0:
            raise JobFailed(f"prepare failed (exit {rc}): {self._last_error()}")
        return out

    def _train(self, data: Path) -> None:
        self.phase = "train"
        cfg = json.loads(json.dumps(self.rec.train_config))
        cfg["data"]["path"] = str(data)
        if not cfg["train"].get("threads") and self.settings.threads:
            cfg["train"]["threads"] = self.settings.threads
        cfg_path = self.run_dir / "train.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self._check_worker(cfg)
        self._check_memory(cfg, data)
        total = int(cfg["train"]["steps"])
        self.metrics = MetricsReader(metrics_path(self.train_dir), total)
        self._beat(force=True)  # reads what earlier attempts logged
        self.metrics.stop = None  # only this attempt's stop record counts
        cmd = ["train", str(cfg_path), "--run-dir", str(self.train_dir), "--resume"]
        self._run_training(cmd, "training")

    def _run_training(self, cmd: list[str], what: str) -> None:
        """Run a phase that trains (``train``, ``adapt``) and read why it stopped."""
        rc, _ = self._run_phase(cmd)
        self.metrics.read()  # type: ignore[union-attr]
        stop = self.metrics.stop or {}  # type: ignore[union-attr]
        if stop.get("reason") == "diverged":  # the trainer's divergence stop (exit 2)
            raise JobFailed(
                f"{diverged_reason(stop)}; no model exported "
                "(its checkpoints are the last finite ones)"
            )
        if rc != 0:
            raise JobFailed(f"{what} failed (exit {rc}): {self._last_error()}")
        if (
            stop.get("reason") == "signal"
        ):  # a SIGTERM we did not send: whoever sent it wants us gone
            raise _Stopped()
        self._say(f"{what} finished ({stop.get('detail', 'done')})")

    def _adapt(self) -> ArtifactInfo:
        """A ``base_model`` job: ``elmo-pretrain adapt`` prepares the corpus with the base
        model's tokenizer, trains (progress and checkpoints as a training job's) and writes
        the model; cancel, retry and re-queue work as for training (it resumes)."""
        from elmo_pretrain.adapt_options import ADAPT_FILE

        self.phase = "train"
        spec, models = self.rec.spec, Path(self.settings.models_dir)
        corpus = resolve_corpus(self.settings.data_dir, spec["corpus"])
        base, dest = models / spec["base_model"], models / self.rec.name
        work = self.run_dir / "adapt"
        self.train_dir = work / "run"
        train = self.rec.train_config["train"]
        self.metrics = MetricsReader(metrics_path(self.train_dir), int(train["steps"]))
        self._beat(force=True)
        self.metrics.stop = None
        opts = AdaptIn.model_validate(spec.get("adapt") or {})
        cmd = ["adapt", str(base), str(corpus), "--out", str(dest), "--work-dir", str(work)]
        cmd += ["--steps", str(train["steps"]), "--max-minutes", str(train["max_minutes"])]
        cmd += ["--no-progress", *opts.cli_args()]
        if not opts.threads and self.settings.threads:
            cmd += ["--threads", str(self.settings.threads)]
        if (work / ADAPT_FILE).is_file():  # an earlier attempt's: continue it
            cmd.append("--resume")
        elif dest.exists():
            raise JobFailed(f"models folder already holds another model named {self.rec.name!r}")
        self._run_training(cmd, "adaptation")
        if not (dest / "manifest.json").is_file():
            raise JobFailed(f"adaptation wrote no model: {self._last_error()}")
        return artifact_info(self.rec.name, dest)

    def _check_worker(self, cfg: dict[str, Any]) -> None:
        """The API checked threads and device against its settings; this worker's own
        cores and GPUs decide (a job meant for a GPU worker fails here with the reason)."""
        from elmo_service.errors import ConfigError

        threads, cores = int(cfg["train"].get("threads") or 0), machine_cores()
        if threads > cores:
            raise JobFailed(
                f"config.train.threads: {threads} threads, but this worker has {cores} cores"
            )
        try:
            check_device(
                str(cfg["train"].get("device", "auto")), visible_gpus(), "config.train.device"
            )
        except ConfigError as e:
            raise JobFailed(f"{e.message} (on this worker)") from e

    def _check_memory(self, cfg: dict[str, Any], data: Path) -> None:
        """Checked at submit on the API's machine; again here, with the real vocabulary
        and this worker's memory, so a job too big for it fails with the reason instead
        of being killed (and retried) by the out-of-memory killer."""
        from elmo_jobs.memory import check_memory, memory_limit
        from elmo_service.errors import ConfigError

        s = self.settings
        try:
            vocab = json.loads((data / "manifest.json").read_text())["vocab"]["softmax_size"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        try:
            check_memory(
                cfg, int(vocab), memory_limit(s.jobs_max_memory, s.jobs_memory_fraction), "corpus"
            )
        except ConfigError as e:
            raise JobFailed(f"{e.message} (on this worker)") from e

    def _export(self) -> ArtifactInfo:
        from elmo_service.artifact import read_config

        self.phase = "export"
        self._beat(force=True)
        name = self.rec.name
        dest = Path(self.settings.models_dir) / name
        run = str(self.train_dir.resolve())
        if (
            not (dest / "manifest.json").is_file()
            or read_config(dest).get("provenance", {}).get("run") != run
        ):
            if dest.exists():
                raise JobFailed(f"models folder already holds another model named {name!r}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            rc, _ = self._run_phase(["export", str(self.train_dir), str(dest)])
            if rc != 0:
                raise JobFailed(f"export failed (exit {rc}): {self._last_error()}")
        else:
            self._say(f"model {name} was already exported from this run")
        return artifact_info(name, dest)

    def _last_error(self) -> str:
        lines = tail(self.log_path, 20)
        for line in reversed(lines):
            if "error" in line.lower() and not line.startswith("[job "):
                return line.strip()
        return lines[-1].strip() if lines else "no output"

    def _check_stop(self, proc: subprocess.Popen | None) -> None:
        if self._stop_requested:
            self._terminate(proc)
            raise _Stopped()
        if self._cancel:
            self._terminate(proc)
            raise _Cancelled()

    def _terminate(self, proc: subprocess.Popen | None) -> None:
        """SIGTERM: the trainer finishes its step and checkpoints; SIGKILL after the timeout.
        Heartbeats go on meanwhile, so a slow checkpoint does not look like a lost job."""
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.jobs_stop_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(_Superseded):
                self._beat()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.settings.jobs_poll_interval)
        if proc.poll() is None:
            log.warning(
                "job %s: trainer ignored SIGTERM for %.0fs; killing it",
                self.job_id,
                self.settings.jobs_stop_timeout,
            )
            proc.kill()
            proc.wait()

    def _run_phase(self, args: list[str]) -> tuple[int, str]:
        """Run ``python -m elmo_pretrain.cli ARGS``, output appended to the job log.
        Returns (exit code, this phase's output)."""
        self._check_stop(None)  # a cancel or stop that came before the phase started
        self._say(f"phase {self.phase}: elmo-pretrain {' '.join(args)}")
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "elmo_pretrain.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.run_dir,
                env=env,
                pass_fds=(self.lock_fd,),
                preexec_fn=child_setup,  # noqa: PLW1509 - a prctl, nothing thread-unsafe
            )
        try:
            while proc.poll() is None:
                self._beat()
                self._check_stop(proc)
                time.sleep(self.settings.jobs_poll_interval)
        except _Superseded:
            self._terminate(proc)
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(_Superseded):
            self._beat(force=True)
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        if self._stop_requested:
            raise _Stopped()
        if proc.returncode < 0:  # a signal we did not send (ours raise above, in _check_stop)
            raise _Killed(
                f"its {self.phase} process (pid {proc.pid}) was killed by {_signame(-proc.returncode)}"
            )
        return proc.returncode, text


def _signame(sig: int) -> str:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
    # SIGKILL from nobody we know is most often the kernel's out-of-memory killer
    return f"{name} (out of memory?)" if sig == signal.SIGKILL else name
