"""Progress on the long pretrain commands: eval's bar, and a training ETA measured after
the warm-up steps (compilation), not from the first one."""

from __future__ import annotations

import time

import numpy as np
import torch

from elmo_pretrain.evaluate import perplexity
from elmo_pretrain.progress import WARMUP_STEPS, ProgressBar


def test_training_eta_is_measured_after_the_warm_up():
    bar = ProgressBar(total=1000, initial=0, enabled=True, compiled=False)
    try:
        time.sleep(0.3)  # a slow first step (compiling)
        bar.update(1)
        assert "warming up" in str(bar.bar) and "?" not in str(bar.bar)
        bar.update(WARMUP_STEPS)
        for step in range(WARMUP_STEPS + 1, WARMUP_STEPS + 11):
            time.sleep(0.002)
            bar.update(step)
        shown = str(bar.bar)
        assert "warming up" not in shown
        # 10 steps in ~0.02-0.1 s after the warm-up: the ETA for ~987 more is seconds, while
        # the rate from step 0 (the 0.3 s step included) would say about half a minute
        assert bar.bar.n - bar.bar.initial == 10  # the steps the rate is measured over
        eta = (1000 - bar.bar.n) * bar.bar.format_dict["elapsed"] / 10
        assert eta < 15, shown
    finally:
        bar.close()


def test_eval_shows_a_progress_bar_on_stderr(capsys):
    class Uniform(torch.nn.Module):
        directions = "both"

        def exact_nll(self, batch):
            n = float((batch.lengths - 1).clamp_min(0).sum())
            return n * np.log(10), n * np.log(10), int(n)

    class Corpus:
        bos_id, eos_id, unk_id, softmax_size = 0, 1, 2, 10

        def char_table(self, *_):
            return torch.zeros(10, 4, dtype=torch.int32)

    sents = [np.array([2, 3, 4], np.int32)] * 5
    got = perplexity(Uniform(), Corpus(), sents, torch.device("cpu"), progress=True)
    assert abs(got["avg_ppl"] - 10) < 1e-9
    assert "eval" in capsys.readouterr().err
