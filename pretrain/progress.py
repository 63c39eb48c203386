"""The trainer's clock and progress bar: training time across resumes, and a tqdm bar whose
rate (and so its ETA) is measured only after the first steps, which compile or fill caches."""

from __future__ import annotations

import time

from tqdm import tqdm

# steps before the progress bar measures its rate (torch.compile compiles each new shape)
WARMUP_STEPS, WARMUP_STEPS_COMPILED = 3, 20


class Clock:
    """Wall-clock bookkeeping of one ``fit``: training time across resumes, the time
    since the last log line and since the last checkpoint."""

    def __init__(self, elapsed0: float) -> None:
        self.t0 = self.t_lap = self.t_ckpt = time.time()
        self.elapsed0 = elapsed0

    def since_start(self) -> float:
        return time.time() - self.t0

    def since_checkpoint(self) -> float:
        return time.time() - self.t_ckpt

    def checkpointed(self) -> None:
        self.t_ckpt = time.time()

    def elapsed(self) -> float:
        return self.elapsed0 + self.since_start()

    def lap(self) -> float:
        """Seconds since the previous lap."""
        now = time.time()
        dt, self.t_lap = now - self.t_lap, now
        return dt


class ProgressBar:
    """tqdm over steps whose rate (and so the ETA) is measured after a warm-up: the first
    steps compile (or fill caches) and would make the first ETA read hours."""

    def __init__(self, total: int, initial: int, enabled: bool, compiled: bool) -> None:
        self.warmup_until = initial + (WARMUP_STEPS_COMPILED if compiled else WARMUP_STEPS)
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            disable=not enabled,
            dynamic_ncols=True,
            smoothing=0,  # the average since the warm-up, not a moving one
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, warming up{postfix}]",
        )

    def update(self, step: int) -> None:
        self.bar.update(step - self.bar.n)
        if step == self.warmup_until:
            self.bar.initial, self.bar.start_t = step, time.time()
            self.bar.bar_format = None  # tqdm's own, with the rate and the remaining time

    def set_postfix(self, **kw) -> None:
        self.bar.set_postfix(**kw)

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
