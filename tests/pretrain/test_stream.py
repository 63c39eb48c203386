"""Stream training (bilm-tf / Kim et al.): rows, windows, carried state, resets, resume, eval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.data import Corpus, StreamBatcher, sentence_stream
from elmo_pretrain.evaluate import load_run, perplexity, stream_perplexity
from elmo_pretrain.run_checks import RunDirError
from elmo_pretrain.train import run_training
from elmo_service.errors import ConfigError, InputError
from tests.pretrain.test_train import corpus_dir, losses, quiet, tiny  # noqa: F401

STREAM = ("data.mode=stream", "data.rows=4", "data.unroll=8")


def test_stream_rows_windows_and_directions(corpus_dir):  # noqa: F811
    corpus = Corpus(corpus_dir)
    split = corpus.split("train")
    stream = sentence_stream(split, corpus.bos_id, corpus.eos_id)
    assert len(stream) == split.n_tokens + 2 * len(split)
    assert stream[0] == corpus.bos_id and stream[-1] == corpus.eos_id
    assert np.array_equal(stream[1 : 1 + split.lens[0]], split.sentence(0))
    b = StreamBatcher(corpus, "train", rows=4, unroll=8, seed=1, shuffle=False)
    rows = b.epoch_rows(0)
    assert np.array_equal(rows[1], stream[b.row_len : 2 * b.row_len])
    batch = b.batch(0, 2)
    fwd, bwd = batch.windows["forward"], batch.windows["backward"]
    # forward window 2: columns 16..23 predict 17..24; backward: the reversed row's window 2
    assert np.array_equal(fwd.ids.numpy(), rows[:, 16:24])
    assert np.array_equal(bwd.ids.numpy(), rows[:, ::-1][:, 16:24])
    uniq = batch.uniq.numpy()
    assert np.array_equal(uniq[fwd.inverse.numpy()], fwd.ids.numpy())
    assert np.array_equal(uniq[bwd.inverse.numpy()], bwd.ids.numpy())
    # no prediction from one sentence's end marker to the next one's start marker
    x, y = rows[:, 16:24], rows[:, 17:25]
    between = (x == corpus.eos_id) & (y == corpus.bos_id)
    assert np.array_equal(fwd.mask.numpy(), ~between) and fwd.n_pred == int((~between).sum())


def test_shuffled_epochs_differ_and_are_reproducible(corpus_dir):  # noqa: F811
    corpus = Corpus(corpus_dir)
    a = StreamBatcher(corpus, "train", rows=2, unroll=8, seed=5)
    b = StreamBatcher(corpus, "train", rows=2, unroll=8, seed=5)
    assert np.array_equal(a.epoch_rows(1), b.epoch_rows(1))
    assert not np.array_equal(a.epoch_rows(1), a.epoch_rows(2))


def test_reset_probability_zeroes_state_only_at_sentence_starts(corpus_dir):  # noqa: F811
    corpus = Corpus(corpus_dir)
    b = StreamBatcher(corpus, "train", rows=4, unroll=16, seed=1, reset_prob=1.0)
    batch = b.batch(0, 0)
    for d, start in (("forward", corpus.bos_id), ("backward", corpus.eos_id)):
        w = batch.windows[d]
        assert torch.equal(w.keep == 0, w.ids == start)
    none = StreamBatcher(corpus, "train", rows=4, unroll=16, seed=1).batch(0, 0)
    assert none.windows["forward"].keep is None


def test_bad_stream_configs_fail_before_work(corpus_dir, tmp_path):  # noqa: F811
    for bad, field in (
        ("data.unroll=0", "data.unroll"),
        ("data.reset_prob=1.5", "data.reset_prob"),
        ("data.rows=0", "data.rows"),
        ("data.mode=packed", "data.mode"),
    ):
        with pytest.raises(ConfigError, match=field):
            tiny(corpus_dir, *STREAM, bad)
    with pytest.raises(InputError, match="too few") as e:
        run_training(tiny(corpus_dir, *STREAM, "data.rows=100000"), tmp_path / "r", log=quiet)
    assert e.value.field == "data.rows"
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.slow
def test_stream_training_learns_and_resumes_exactly(corpus_dir, tmp_path):  # noqa: F811
    """Carried state and the sentence-boundary resets survive a stop: 2 x 10 steps == 20 steps."""
    sets = (*STREAM, "data.reset_prob=0.3", "train.steps=20", "train.log_every=1")
    sets += ("checkpoint.every_steps=0", "softmax.kind=full")
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_training(tiny(corpus_dir, *sets), one, log=quiet)
    assert res["heldout"]["protocol"] == "stream" and math.isfinite(res["heldout"]["avg_ppl"])
    run_training(tiny(corpus_dir, *sets), two, stop_after=10, log=quiet)
    st = ckpt.load_latest(two)[1]
    assert st["data"]["mode"] == "stream"
    h, c = st["lstm_state"]["forward"][0]
    assert h.shape == (4, 16) and c.shape == (4, 32) and h.abs().sum() > 0  # a carried state
    run_training(tiny(corpus_dir, *sets), two, resume=True, log=quiet)
    assert losses(one) == losses(two) and len(losses(one)) == 20
    assert losses(one)[-1] < losses(one)[0]
    a, b = ckpt.load_latest(one)[1], ckpt.load_latest(two)[1]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_resuming_across_modes_is_refused(corpus_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=2"), run, log=quiet)
    with pytest.raises(RunDirError, match="data.mode=sentences") as e:
        run_training(tiny(corpus_dir, "train.steps=4", *STREAM), run, resume=True, log=quiet)
    assert e.value.field == "data.mode"


@pytest.mark.slow
def test_plateau_schedule_halves_lr_when_perplexity_stalls(corpus_dir, tmp_path):  # noqa: F811
    """A threshold no epoch can beat: every epoch after the first halves the lr."""
    # 32 rows: an epoch of few steps (the schedule acts on epochs, not on steps)
    sets = (*STREAM, "data.unroll=16", "data.rows=32", "optim.name=sgd", "optim.lr=0.5")
    sets += ("optim.decay=plateau",)
    sets += ("optim.warmup_steps=0", "optim.plateau_threshold=1000000000.0", "train.log_every=1")
    run = tmp_path / "run"
    cfg = tiny(corpus_dir, *sets, "train.eval_max_sentences=20")
    from elmo_pretrain.train import Trainer

    epoch = len(Trainer(cfg, tmp_path / "probe", log=quiet).batcher)
    run_training(tiny(corpus_dir, *sets, f"train.steps={3 * epoch + 1}"), run, log=quiet)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    scales = [r["lr_scale"] for r in recs if "lr_scale" in r]
    assert scales == [1.0, 0.5, 0.25]
    assert [r["lr"] for r in recs if "lr" in r][-1] == pytest.approx(0.125)


@pytest.mark.slow
def test_stream_eval_of_one_sentence_is_the_sentence_eval(corpus_dir, tmp_path):  # noqa: F811
    """A one-sentence stream starts from zeros like a sentence: the two protocols agree;
    on many sentences the carried state makes them differ."""
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, "train.steps=6"), run, log=quiet)
    _, corpus, lm, _ = load_run(run)
    split = corpus.split("heldout")
    sents = [np.asarray(split.sentence(i)) for i in range(12)]
    cpu = torch.device("cpu")
    one_s, one_t = (
        perplexity(lm, corpus, sents[:1], cpu),
        stream_perplexity(lm, corpus, sents[:1], cpu),
    )
    assert one_s["predictions"] == one_t["predictions"] == len(sents[0]) + 1
    for k in ("forward_ppl", "backward_ppl"):
        assert one_t[k] == pytest.approx(one_s[k], rel=1e-5)
    many_s, many_t = perplexity(lm, corpus, sents, cpu), stream_perplexity(lm, corpus, sents, cpu)
    assert many_s["predictions"] == many_t["predictions"]
    assert many_t["forward_ppl"] != pytest.approx(many_s["forward_ppl"], rel=1e-6)
    # windowing does not change the stream figure
    small = stream_perplexity(lm, corpus, sents, cpu, window=7)
    assert small["forward_ppl"] == pytest.approx(many_t["forward_ppl"], rel=1e-6)


def test_sum_over_time_loss_is_the_literature_scale(corpus_dir):  # noqa: F811
    """sum_over_time: NLL summed over a window's steps, averaged over rows (Kim et al.'s lr 1)."""
    from elmo_pretrain.train import build_model

    cfg = tiny(corpus_dir, *STREAM, "train.directions=forward", "model.dropout=0.0")
    corpus = Corpus(corpus_dir)
    lm = build_model(cfg, corpus)
    batch = StreamBatcher(corpus, "train", rows=4, unroll=8, seed=1, directions=("forward",)).batch(
        0, 0
    )
    torch.manual_seed(0)
    mean_loss, nll_f, _, _ = (
        x.detach() if torch.is_tensor(x) else x for x in lm(batch, None, stream=True)
    )
    lm.loss_reduction = "sum_over_time"
    torch.manual_seed(0)
    sum_loss, _, _, _ = lm(batch, None, stream=True)
    n_pred = batch.windows["forward"].n_pred
    assert float(mean_loss) == pytest.approx(float(nll_f) / n_pred, rel=1e-6)
    assert float(sum_loss.detach()) == pytest.approx(float(nll_f) / 4, rel=1e-6)
