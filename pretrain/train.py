"""`elmo-pretrain train`: the training loop, plain and in one place.

Three parts: the set-up (``Trainer.__init__``: a page of plain statements; the longer
steps in ``train_setup.py``), the loop (``fit``, ``_loop``, ``train_step``), and the state a
checkpoint holds and ``--resume`` restores (``train_state.py`` ``TrainState``).

    for step in range(start, cfg.train.steps):
        batch = batcher.batch(epoch, index)          # [B, T] ids, deterministic in (seed, epoch, index)
        loss = model(batch)                          # mean of forward and backward LM losses
        loss.backward(); clip; optimizer.step()      # lr from lr_at(step)
        log / evaluate / checkpoint                  # rank 0 writes; all ranks agree on stopping

Runs single-process or under ``torchrun`` (DDP: gloo on CPU, nccl on CUDA;
each rank takes every world-th batch of the same epoch plan). Model init uses
``train.seed`` on every rank; dropout and negative sampling use
``seed + rank``; all of it is saved per rank in checkpoints, so ``--resume``
continues exactly where the run stopped (same losses in fp32 eager).

SIGTERM / SIGINT set a flag; the current step finishes, a checkpoint is
written and the process exits 0 (before this process's first step, e.g. while it
compiles, it stops at once: nothing new to save); called from Python, the signal then
goes on to the handler that was there before (``pretrain/signals.py``). A non-finite loss, gradient norm,
weights or held-out perplexity stops the run (``TrainingDiverged``, exit 2) before
anything of it is saved; ``optim.nonfinite: skip`` drops such updates instead.
How a run ends, with its exit codes: docs/training.md.
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elmo_pretrain import ddp
from elmo_pretrain.checkpoint import describe_nonfinite, nonfinite_tensors, save_checkpoint
from elmo_pretrain.config import TrainConfig
from elmo_pretrain.data import BucketBatcher, Corpus, StreamBatcher, to_device
from elmo_pretrain.lm import LanguageModel
from elmo_pretrain.optim import build_model, make_optimizer
from elmo_pretrain.progress import Clock, ProgressBar
from elmo_pretrain.run_checks import check_mode, check_run_dir
from elmo_pretrain.signals import Interrupted, StopSignals
from elmo_pretrain.tracking import MetricsLog, stop_record
from elmo_pretrain.train_setup import (
    compile_model,
    data_summary,
    init_run_dir,
    open_corpus,
    place,
    wrap,
)
from elmo_pretrain.train_state import TrainState, last_good
from elmo_service.errors import ElmoServiceError, InputError
from elmo_service.runtime import autocast, resolve_precision

# ---------------------------------------------------------------- how a run fails


class TrainingDiverged(ElmoServiceError):
    """A non-finite loss, gradient norm or weights: the run stops, nothing of it is saved."""

    code = "diverged"


class CorpusMissing(InputError):
    """The prepared corpus went away while training."""


@dataclass(frozen=True)
class Remedies:
    """What a divergence refusal tells the user to do, in the flags of the command that
    runs the trainer (``train``'s config keys; ``adapt`` passes its own)."""

    lower_lr: str = "lower optim.lr or set optim.clip_norm"
    start_over_flag: str = "--force"
    skip_nonfinite: str | None = "--resume --set optim.nonfinite=skip"

    def start_over(self, skip: bool = False) -> str:
        text = f"{self.lower_lr} and start over ({self.start_over_flag})"
        return f"{text}, or {self.skip_nonfinite}" if skip and self.skip_nonfinite else text


# ---------------------------------------------------------------- set-up, loop


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        resume: bool = False,
        force: bool = False,
        hand_on_signals: bool = True,
        init: Callable[[LanguageModel], None] | None = None,
        remedies: Remedies = Remedies(),
        log=print,
    ) -> None:
        """The set-up, in order. ``hand_on_signals``: after a run a signal stopped, give the
        signal to the handler that was there before (``pretrain/signals.py``); the CLI, which
        owns its process, passes False. ``init``: sets the built model's starting weights
        (``adapt``: a trained biLM's); a resumed run's checkpoint replaces them."""
        self.cfg, self.run_dir, self.log, self.remedies = cfg, Path(run_dir), log, remedies
        self.hand_on_signals = hand_on_signals
        # where: rank, device, threads, the process group
        self.at = place(cfg)
        self.rank, self.world, self.device = self.at.rank, self.at.world, self.at.device
        self.ddp = self.world > 1
        # the run folder: new, resumed or started over (every rank checks; rank 0 writes)
        if not force:
            check_mode(self.run_dir, cfg)
        self.mode = check_run_dir(self.run_dir, cfg, resume, force)
        # the data: batches deterministic in (seed, epoch, index), every world-th one per rank
        self.corpus = open_corpus(cfg)
        self._corpus_manifest = self.corpus.path / "manifest.json"
        self.stream = cfg.data.mode == "stream"
        self.batcher = make_batcher(cfg, self.corpus, self.rank, self.world)
        # the model, identical on every rank, and what trains it
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, self.corpus)
        if init is not None:
            init(self.model)
        self.model.to(self.device)
        precision = resolve_precision(self.device, cfg.train.precision)
        self.state = TrainState(
            model=self.model,
            optimizer=make_optimizer(self.model.parameters(), cfg.optim),
            # fp16 needs loss scaling; elsewhere the scaler is a no-op: the loop has no branches
            scaler=torch.amp.GradScaler(self.device.type, enabled=precision == "fp16"),
            precision=precision,
        )
        self._barrier()
        if self.rank == 0:
            init_run_dir(self.run_dir, cfg, self.corpus, self.world, self.mode)
        self._barrier()
        # dropout and negative sampling: a stream per rank (saved per rank in checkpoints)
        torch.manual_seed(cfg.train.seed + 1000 * self.rank + 1)
        if self.mode == "resume":
            self.state.resume(self.run_dir, cfg, self.at, self.log)
        self.net = wrap(self.model, self.at)  # DDP averages the gradients across ranks
        if cfg.train.compile:
            compile_model(self.model)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.signals = StopSignals()
        self._steps_here = 0  # optimizer steps taken by this process (a resume starts at 0)
        self._skips = 0  # consecutive non-finite steps skipped (optim.nonfinite: skip)

    @property
    def precision(self) -> str:
        return self.state.precision

    @property
    def elapsed(self) -> float:
        """Training seconds, across resumes."""
        return self.state.elapsed

    def _barrier(self) -> None:
        ddp.barrier(self.world)

    def _lr(self, step: int) -> float:
        return self.state.lr(self.cfg, step)

    def last_good(self) -> str:
        return last_good(self.run_dir)

    def save(self) -> Path | None:
        # every rank holds the same weights, so every rank stops here alike
        if bad := nonfinite_tensors(self.model.state_dict()):
            raise TrainingDiverged(
                f"training diverged at step {self.state.step}: the update left non-finite weights "
                f"({describe_nonfinite(bad, len(self.model.state_dict()))}); not saved, "
                f"{self.last_good()}; {self.remedies.start_over()}",
                field="optim.lr",
            )
        st = self.state.checkpoint(self.cfg, self.at)  # collective: every rank calls it
        path = None
        if self.rank == 0:
            path = save_checkpoint(self.run_dir, self.state.step, st, keep=self.cfg.checkpoint.keep)
        self._barrier()
        return path

    # -- evaluation --------------------------------------------------------
    def evaluate(self, max_sentences: int | None = None) -> dict[str, float] | None:
        """Held-out perplexity, in the training regime's protocol (sentences or one stream)."""
        from elmo_pretrain.evaluate import perplexity, stream_perplexity

        split = self.corpus.split("heldout")
        if len(split) == 0:
            return None
        n = len(split) if not max_sentences else min(len(split), max_sentences)
        sents = [split.sentence(i) for i in range(n)]
        if self.stream:
            return stream_perplexity(self.model, self.corpus, sents, self.device, "fp32")
        return perplexity(self.model, self.corpus, sents, self.device, "fp32")

    def _epoch_end(self, metrics) -> None:
        """Plateau decay (Kim et al.): evaluate, and cut the lr when the perplexity stalled."""
        o = self.cfg.optim
        if o.decay != "plateau":
            return
        ev = None
        if self.rank == 0:
            ev = self.evaluate(self.cfg.train.eval_max_sentences)
            self.model.train()
        ppl = torch.tensor(
            [ev.get("avg_ppl", ev["forward_ppl"]) if ev else -1.0], dtype=torch.float64
        )
        ddp.broadcast_from_first(ppl, self.world)
        value = float(ppl)
        if value < 0:
            return
        decayed = (
            self.state.best_eval is not None and value > self.state.best_eval - o.plateau_threshold
        )
        if decayed:
            self.state.lr_scale *= o.plateau_factor
        self.state.best_eval = (
            value if self.state.best_eval is None else min(self.state.best_eval, value)
        )
        if self.rank == 0:
            rec = {
                "step": self.state.step,
                "epoch": self.state.epoch,
                "heldout": ev,
                "lr_scale": self.state.lr_scale,
            }
            metrics.record(rec)
            self.log(
                f"epoch {self.state.epoch} done (step {self.state.step}): held-out ppl {value:.2f}"
                + (f"; lr x{o.plateau_factor} -> {o.lr * self.state.lr_scale:g}" if decayed else "")
            )

    # -- the loop ----------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until ``train.steps`` (or ``stop_after`` steps in this call, a signal, the time
        limit, a divergence). Each step: ``train_step`` (forward, backward, clip), one all-reduce
        of its figures and flags, then the decisions every rank agrees on (``_decide``)."""
        tc = self.cfg.train
        metrics = MetricsLog(self.run_dir) if self.rank == 0 else None  # + TensorBoard if installed
        self.signals.install()
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.model.parameters())
            self.log(
                f"training {n_params / 1e6:.2f}M params on {self.world} process(es), device {self.device}, "
                f"{self.precision}{' + compile' if tc.compile else ''}; "
                + data_summary(self.cfg, self.batcher, self.stream, self.state.epoch)
            )
        bar = ProgressBar(tc.steps, self.state.step, tc.progress and self.rank == 0, tc.compile)
        self._clock = Clock(elapsed0=self.state.elapsed)
        self.model.train()
        try:
            try:
                stop = self._loop(stop_after, bar, metrics)
            except Interrupted as e:  # a signal before this process's first step: nothing new
                stop = ("signal", f"signal {signal.Signals(e.signum).name} before the first step")
            finally:
                self.signals.immediate = False  # from here a signal only sets the flag
                bar.close()
            stop_kind, stop_reason = stop or ("finished", "done")
            result: dict[str, Any] = {
                "step": self.state.step,
                "tokens_seen": self.state.tokens_seen,
                "stopped": stop_reason,
            }
            if self.ddp:
                result["ddp_params_identical"] = self._check_replicas(metrics)
            if stop_kind == "finished":
                ev = self._log_eval(metrics, tc.eval_max_sentences)
                if ev:
                    result["heldout"] = ev
        except Exception as e:  # the reason, as data, for whoever follows metrics.jsonl
            if metrics:
                kind = "diverged" if isinstance(e, TrainingDiverged) else "error"
                detail = e.message if isinstance(e, ElmoServiceError) else f"{e!r}"
                with contextlib.suppress(OSError):  # a full disk: the error itself says so
                    metrics.record(
                        stop_record(kind, self.state.step, self.state.tokens_seen, detail[:500])
                    )
                    metrics.close()
            raise
        finally:
            self.signals.restore()
        if metrics:
            metrics.record(
                stop_record(stop_kind, self.state.step, self.state.tokens_seen, stop_reason)
            )
            metrics.close()
        if self.rank == 0:
            self.log(
                f"stopped at step {self.state.step} ({stop_reason}); {self.state.tokens_seen} tokens seen in {self.state.elapsed / 60:.1f} min"
            )
        if self.hand_on_signals:
            self.signals.hand_on()  # e.g. KeyboardInterrupt: Ctrl-C ends the caller too
        return result

    def _loop(self, stop_after: int | None, bar: ProgressBar, metrics) -> tuple[str, str] | None:
        """Steps until ``train.steps`` or a stop; returns (stop kind, words) or None when done."""
        tc, st = self.cfg.train, self.state
        window = torch.zeros(4, dtype=torch.float64)  # since the last log: NLL f, b, preds, tokens
        stop: tuple[str, str] | None = None
        self.signals.immediate = self._steps_here == 0
        while stop is None and st.step < tc.steps:
            if st.index >= self._epoch_len():
                self._epoch_end(metrics)
                st.epoch, st.index = st.epoch + 1, 0
                st.lstm_state = None  # each epoch's stream starts from zeros
                continue
            batch = to_device(self.batcher.batch(st.epoch, st.index), self.device)
            lr = self._lr(st.step)
            for g in st.optimizer.param_groups:
                g["lr"] = lr
            figures, gnorm = self.train_step(batch)
            stats = self._agree(figures)  # the one all-reduce a step
            if not self._finite_step(stats, gnorm, lr):
                continue  # optim.nonfinite=skip: this update dropped, lr cut
            st.scaler.step(st.optimizer)  # a plain optimizer.step() in fp32/bf16
            st.scaler.update()
            st.optimizer.zero_grad(set_to_none=True)
            st.step, st.index = st.step + 1, st.index + 1
            self._steps_here += 1
            self.signals.immediate = False
            window += stats[:4]
            st.tokens_seen += int(stats[3])
            st.elapsed = self._clock.elapsed()
            if st.step % tc.log_every == 0 or st.step == tc.steps:
                self._log_window(window, self._clock.lap(), lr, float(gnorm), bar, metrics)
                window.zero_()
            bar.update(st.step)
            if tc.eval_every and st.step % tc.eval_every == 0 and st.step < tc.steps:
                self._log_eval(metrics, tc.eval_max_sentences)
            stop = self._decide(stats, stop_after, bar)
        return stop

    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward on one batch, gradients clipped; the optimizer has not stepped.
        Returns this rank's ``[NLL fwd, NLL bwd, predictions, tokens]`` and the gradient norm."""
        with autocast(self.device, self.precision):
            if self.stream:
                loss, nll_f, nll_b, self.state.lstm_state = self.net(
                    batch, self.state.lstm_state, stream=True
                )
                n_pred = float(batch.windows["forward"].n_pred)
            else:
                loss, nll_f, nll_b = self.net(batch)
                n_pred = float((batch.lengths - 1).clamp_min(0).sum())
        self.state.scaler.scale(loss).backward()  # GradScaler(enabled=False): loss.backward()
        self.state.scaler.unscale_(self.state.optimizer)
        clip = self.cfg.optim.clip_norm
        gnorm = torch.nn.utils.clip_grad_norm_(self._trainable, clip if clip > 0 else float("inf"))
        figures = torch.tensor(
            [nll_f.item(), nll_b.item(), n_pred, float(batch.n_tokens)], dtype=torch.float64
        )
        return figures, gnorm

    def _agree(self, figures: torch.Tensor) -> torch.Tensor:
        """``figures`` summed over ranks, with the flags every rank must agree on:
        [4] a stop was asked for (signal, time limit), [5] a checkpoint is due by time,
        [6] the prepared corpus has gone."""
        ck, tc = self.cfg.checkpoint, self.cfg.train
        flags = [
            self.signals.received is not None
            or (tc.max_minutes > 0 and self._clock.since_start() > 60 * tc.max_minutes),
            ck.every_minutes > 0 and self._clock.since_checkpoint() > 60 * ck.every_minutes,
            not self._corpus_present(),
        ]
        stats = torch.cat([figures, torch.tensor(flags, dtype=torch.float64)])
        if self.ddp:
            dist.all_reduce(stats)
        return stats

    def _finite_step(self, stats: torch.Tensor, gnorm: torch.Tensor, lr: float) -> bool:
        """False: skip this update (``optim.nonfinite: skip``). Raises TrainingDiverged to stop.

        The loss is checked on every rank's sum, the gradient norm after DDP averaged the
        gradients, so every rank decides alike. Under fp16 the GradScaler skips steps with
        non-finite gradients itself (and lowers its scale): that is routine, not divergence.
        """
        bad = (
            [f"loss {float(stats[0] + stats[1]):g}"] if not bool(stats[:2].isfinite().all()) else []
        )
        if not self.state.scaler.is_enabled() and not bool(torch.isfinite(gnorm)):
            bad.append(f"gradient norm {float(gnorm):g}")
        if not bad:
            self._skips = 0
            return True
        o = self.cfg.optim
        self.state.optimizer.zero_grad(set_to_none=True)
        if o.nonfinite == "skip" and self._skips < o.nonfinite_max_skips:
            self._skips += 1
            self.state.lr_scale *= o.nonfinite_factor
            if self.stream:
                self.state.lstm_state = None  # the carried state came from the same broken forward
            if self.rank == 0:
                self.log(
                    f"step {self.state.step + 1}: non-finite {' and '.join(bad)}; update skipped, "
                    f"lr x{o.nonfinite_factor} -> {lr * o.nonfinite_factor:g} "
                    f"({self._skips}/{o.nonfinite_max_skips} in a row)"
                )
            self.state.index += 1  # the next batch: this one would fail the same way
            return False
        raise TrainingDiverged(
            f"training diverged at step {self.state.step + 1}: non-finite {' and '.join(bad)} (lr {lr:g}); "
            f"nothing from this step was saved, {self.last_good()}; "
            f"{self.remedies.start_over(skip=True)}",
            field="optim.lr",
        )

    def _decide(self, stats: torch.Tensor, stop_after: int | None, bar) -> tuple[str, str] | None:
        """After a step: checkpoint when due, and stop when asked (all ranks agree: the flags
        were all-reduced, and saving is collective). Returns (stop kind, words) or None."""
        ck, tc = self.cfg.checkpoint, self.cfg.train
        asked, time_due, corpus_gone = (bool(x > 0) for x in stats[4:7])
        hit_limit = (
            stop_after is not None and self._steps_here >= stop_after and self.state.step < tc.steps
        )
        due = bool(ck.every_steps and self.state.step % ck.every_steps == 0) or time_due
        if asked or hit_limit or due or corpus_gone or self.state.step == tc.steps:
            path = self.save()
            self._clock.checkpointed()
            if self.rank == 0 and path is not None:
                bar.write(f"checkpoint {path.name}")
        if corpus_gone:
            raise CorpusMissing(
                f"the prepared corpus {self.cfg.data.path} disappeared during training (at step "
                f"{self.state.step}; checkpoint written); restore it and --resume",
                field="data.path",
            )
        if asked:
            if self.signals.received is not None:
                return "signal", f"signal {signal.Signals(self.signals.received).name}"
            if tc.max_minutes > 0:
                return "max_minutes", "time limit"
            return "signal", "signal on another rank"
        if hit_limit:
            return "stop_after", f"stop after {stop_after} steps"
        return None

    def _corpus_present(self) -> bool:
        """The prepared corpus is still there (a stat a step: the shards are memory-mapped,
        so its deletion would otherwise surface only at export)."""
        return self._corpus_manifest.is_file()

    def _epoch_len(self) -> int:
        return len(self.batcher) if self.stream else len(self.batcher.plan(self.state.epoch))

    def _check_replicas(self, metrics) -> bool:
        """DDP sanity check: every rank holds bit-identical parameters."""
        same = ddp.params_identical(self.model, self.world, self.device)
        if self.rank == 0:
            rec = {"step": self.state.step, "ddp_world": self.world, "ddp_params_identical": same}
            metrics.record(rec)
            if not same:
                self.log("warning: DDP replicas hold different parameters")
        return same

    def _log_window(
        self, w: torch.Tensor, dt: float, lr: float, gnorm: float, bar, metrics
    ) -> None:
        nf, nb, n, toks = (float(x) for x in w)
        n = max(n, 1.0)
        loss = nf / n if self.cfg.train.directions == "forward" else (nf + nb) / (2 * n)
        rec = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "tokens_seen": self.state.tokens_seen,
            "loss": round(loss, 5),
            "ppl": round(math.exp(min(loss, 50)), 3),
            "loss_fwd": round(nf / n, 5),
            "lr": lr,
            "grad_norm": round(gnorm, 4),
            "tok_s": round(toks / max(dt, 1e-9), 1),
            "elapsed_s": round(self.state.elapsed, 1),
        }
        if self.cfg.train.directions == "both":
            rec["loss_bwd"] = round(nb / n, 5)
        if self.rank == 0:
            bar.set_postfix(
                loss=f"{loss:.3f}",
                ppl=f"{rec['ppl']:.1f}",
                tok_s=f"{rec['tok_s']:.0f}",
                refresh=False,
            )
            metrics.record(rec)

    def _log_eval(self, metrics, max_sentences: int | None):
        ev = None
        if self.rank == 0:
            ev = self.evaluate(max_sentences)
            self.model.train()
            if ev:
                metrics.record({"step": self.state.step, "heldout": ev})
                self.log(
                    f"step {self.state.step}: held-out ppl "
                    + ", ".join(f"{k} {v:.2f}" for k, v in ev.items() if k.endswith("ppl"))
                )
        # a perplexity past float range (mean NLL > 709 nats) is a diverged model, even with
        # finite weights: stop here rather than finish and ship it (rank 0 tells the others)
        overflow = ev is not None and not all(
            math.isfinite(v) for k, v in ev.items() if k.endswith("ppl")
        )
        flag = ddp.broadcast_from_first(
            torch.tensor([float(overflow)], dtype=torch.float64), self.world
        )
        if flag.item():
            nll = f" (forward mean NLL {ev['forward_nll']:.4g} nats)" if ev else ""
            raise TrainingDiverged(
                f"training diverged by step {self.state.step}: the held-out perplexity is not finite"
                f"{nll}; its checkpoints hold these weights: {self.remedies.start_over()}",
                field="optim.lr",
            )
        return ev


def make_batcher(cfg: TrainConfig, corpus: Corpus, rank: int, world: int):
    """This rank's batches: sentences bucketed by length, or stream windows."""
    c, seed = cfg.data, cfg.train.seed
    if c.mode == "stream":
        both = cfg.train.directions != "forward"
        return StreamBatcher(
            corpus,
            "train",
            rows=c.rows,
            unroll=c.unroll,
            seed=seed,
            reset_prob=c.reset_prob,
            shuffle=c.shuffle,
            directions=("forward", "backward") if both else ("forward",),
            rank=rank,
            world=world,
        )
    return BucketBatcher(
        corpus,
        "train",
        max_tokens=c.max_tokens,
        tokens_per_batch=c.tokens_per_batch,
        pad_multiple=c.pad_multiple,
        seed=seed,
        rank=rank,
        world=world,
    )


def run_training(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    force: bool = False,
    stop_after: int | None = None,
    hand_on_signals: bool = True,
    log=print,
    say=None,
) -> dict[str, Any]:
    trainer = Trainer(
        cfg, run_dir, resume=resume, force=force, hand_on_signals=hand_on_signals, log=log
    )
    try:
        return trainer.fit(stop_after=stop_after)
    except ElmoServiceError as e:
        # DDP: rank 0 says why before the last barrier; once a rank has exited, torchrun
        # stops the others, and a line printed after that could be lost
        if say is not None and trainer.ddp and trainer.rank == 0:
            say(e)
            e.said = True
        raise
    finally:
        if trainer.ddp and dist.is_initialized():
            # the DDP reducer goes first, while the group is still registered: freed after
            # destroy_process_group, it would take the gloo group down with it while holding
            # the GIL, joining a gloo thread that waits for the GIL to free a tensor (a hang
            # at exit, seen about once in five two-node runs)
            trainer.net = trainer.model
            gc.collect()
            # every rank leaves its last collective (rank 0's end-of-run evaluation and its
            # broadcast) before the group goes: none tears it down under another
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()
