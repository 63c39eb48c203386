"""SIGTERM / SIGINT while training: borrowed for the run, then given back.

While ``fit`` runs, a signal sets a flag: the current step finishes, a checkpoint is
written and the run stops (``"signal"``). Before this process's first step (e.g. while
``torch.compile`` compiles it) there is nothing new to save, so the handler raises
:class:`Interrupted` and the run stops at once.

When ``fit`` returns, the previous handlers are back. A caller inside a larger program (a
test under pytest, a notebook) then gets the signal too (``hand_on``): the previous
handler runs, e.g. Python's ``KeyboardInterrupt`` for Ctrl-C, so Ctrl-C ends the program as
it would have without the trainer, after the checkpoint. The CLI owns its process and
does not hand on: a signal there means "checkpoint and exit 0" (docs/training.md).
"""

from __future__ import annotations

import contextlib
import signal
import warnings

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """SIGTERM/SIGINT before this process's first step (raised from the signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """The run's hold on SIGTERM and SIGINT: ``install``, read ``received``, ``restore``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.immediate = False  # in the loop, no step taken yet: a signal stops at once
        self._old: dict[int, object] = {}

    def install(self) -> None:
        for s in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._old[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum
        if self.immediate:
            # torch.compile traces the backward under autograd's anomaly mode, which would
            # print this interruption as "Error detected in ...Backward0. Traceback ...":
            # the stop is ours, not an error
            warnings.filterwarnings("ignore", message="Error detected in")
            raise Interrupted(signum)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for s, h in self._old.items():
            signal.signal(s, h)

    def hand_on(self) -> None:
        """Deliver the signal this run took (if any) to the handler it was meant for, which
        may raise (``KeyboardInterrupt``) or end the process (the default action)."""
        got = self.received
        if got is None or got not in self._old:
            return
        previous = self._old[got]
        if callable(previous):
            previous(got, None)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(got)
