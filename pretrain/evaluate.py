"""`elmo-pretrain eval`: exact perplexity of a run (or an exported LM) at a checkpoint.

Perplexity is exact whatever softmax trained the model: the full softmax (or
the adaptive softmax's full log-probabilities) over the whole vocabulary, in
float32, dropout off. Two protocols:

* **sentences** (default): each sentence from a zero state, as served.
* **stream** (``--stream``, the language-modelling literature's protocol):
  the file is one stream ``<S> s1 </S> <S> s2 </S> ...`` read with carried
  state, never reset; the backward LM reads it reversed. The step from one
  sentence's end marker to the next one's start marker is not counted.

Both count n + 1 predictions a sentence. Per direction it is
``exp(sum NLL / n)`` over n = tokens + 1 predictions a sentence (``</S>`` for
the forward LM, ``<S>`` for the backward one); ``avg_ppl`` is
``exp((NLL_f + NLL_b) / 2n)``, the geometric mean of the two, which is what
bilm-tf reports as its average perplexity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from elmo_pretrain.checkpoint import list_checkpoints, load_checkpoint
from elmo_pretrain.config import TrainConfig
from elmo_pretrain.data import Corpus, eval_batches, stream_eval_batches, to_device
from elmo_pretrain.lm import LanguageModel
from elmo_pretrain.run_dir import LM_WEIGHTS, RUN_FILE, checkpoint_step, run_info_path
from elmo_service.errors import ConfigError, InputError
from elmo_service.runtime import autocast, pick_device, set_threads


def perplexity(
    model: LanguageModel,
    corpus: Corpus,
    sentences: list[np.ndarray],
    device,
    precision: str = "fp32",
    tokens_per_batch: int = 4096,
    progress: bool = False,
) -> dict[str, float]:
    """Perplexity of ``sentences``, each from a zero state (see the module docstring)."""

    def score(batch, state):
        return (*model.exact_nll(batch), None)

    batches = eval_batches(sentences, corpus, tokens_per_batch)
    return _score(model, batches, score, device, precision, sentences, "sentences", progress)


def stream_perplexity(
    model: LanguageModel,
    corpus: Corpus,
    sentences: list[np.ndarray],
    device,
    precision: str = "fp32",
    window: int = 512,
    progress: bool = False,
) -> dict[str, float]:
    """Perplexity of ``sentences`` read as one stream with carried state (see the module docstring)."""
    batches = stream_eval_batches(sentences, corpus, model.direction_names, window)
    return _score(
        model, batches, model.stream_nll, device, precision, sentences, "stream", progress
    )


@torch.no_grad()
def _score(model, batches, score, device, precision, sentences, protocol: str, progress: bool):
    """Sum ``score(batch, state) -> (NLL_f, NLL_b, predictions, state)`` over batches, in eval mode."""
    was_training = model.training
    model.eval()
    nf = nb = 0.0
    n = 0
    state = None
    total = sum(len(s) + 1 for s in sentences)  # predictions a direction: tokens + 1 a sentence
    bar = tqdm(
        total=total, desc="eval", unit="pred", unit_scale=True, disable=not progress, leave=False
    )
    try:
        for batch in batches:
            with autocast(device, precision):
                f, b, k, state = score(to_device(batch, device), state)
            nf, nb, n = nf + f, nb + b, n + k
            bar.update(k)
    finally:
        bar.close()
        model.train(was_training)
    return _ppl_record(model, len(sentences), n, nf, nb, protocol)


def exp_or_inf(x: float) -> float:
    """``math.exp`` that gives ``inf`` instead of raising OverflowError (a diverged model's
    mean NLL can pass 709 nats); NaN stays NaN. JSON writers turn both into null."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _ppl_record(model, n_sent: int, n: int, nf: float, nb: float, protocol: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "protocol": protocol,
        "sentences": n_sent,
        "predictions": n,
        "forward_nll": nf / n,
        "forward_ppl": exp_or_inf(nf / n),
    }
    if model.directions == "both":
        out.update(
            backward_nll=nb / n,
            backward_ppl=exp_or_inf(nb / n),
            avg_ppl=exp_or_inf((nf + nb) / (2 * n)),
        )
    return out


def load_run(
    run_dir: str | Path, checkpoint: str | Path | None = None, data_path: str | None = None
) -> tuple[TrainConfig, Corpus, LanguageModel, dict[str, Any]]:
    """Config, corpus and model of a run at a checkpoint (default: the newest)."""
    run_dir = Path(run_dir)
    info_path = run_info_path(run_dir)
    if not info_path.is_file():
        raise ConfigError(f"{run_dir} is not a training run (no {RUN_FILE})", field="run_dir")
    run_info = json.loads(info_path.read_text())
    cfg = TrainConfig.from_dict(run_info["config"])
    if data_path:
        cfg.data.path = data_path
    lm_file = run_dir / LM_WEIGHTS
    if lm_file.is_file() and checkpoint is None:  # an exported LM (see export.export_lm)
        from safetensors.torch import load_file

        if not data_path:
            cfg.data.path = str(run_dir / cfg.data.path)
        info = run_info["lm"]
        st = {"model": load_file(str(lm_file)), **info}
        checkpoint = lm_file
    else:
        recorded = run_info.get("corpus", {}).get("path")
        if not data_path and recorded and not (Path(cfg.data.path) / "manifest.json").is_file():
            # a relative data.path read from another working directory: the corpus the run
            # recorded (absolute) when it started
            cfg.data.path = recorded
        found = list_checkpoints(run_dir)
        if checkpoint is None:
            if not found:
                raise ConfigError(f"{run_dir} has no checkpoint yet", field="checkpoint")
            checkpoint = found[-1]
        elif not Path(checkpoint).is_file():
            # a step number, or a checkpoint's name in the run folder
            step = int(checkpoint) if str(checkpoint).isdigit() else None
            named = [p for p in found if p.name == str(checkpoint) or checkpoint_step(p) == step]
            if not named:
                have = ", ".join(p.name for p in found) or "none"
                raise ConfigError(
                    f"no checkpoint {checkpoint!r} in {run_dir} (give a file, a name or a "
                    f"step; the run has: {have})",
                    field="checkpoint",
                )
            checkpoint = named[0]
        st = load_checkpoint(checkpoint)
    corpus = Corpus(cfg.data.path)
    model = LanguageModel(
        cfg.model,
        cfg.softmax,
        corpus.softmax_size,
        corpus.char_table(cfg.model.max_chars_per_token),
        cfg.train.directions,
    )
    model.load_state_dict(st["model"])
    model.eval()
    meta = {
        "checkpoint": Path(checkpoint).name,
        "step": int(st["step"]),
        "tokens_seen": int(st["tokens_seen"]),
    }
    return cfg, corpus, model, meta


def evaluate(
    run_dir: str | Path,
    *,
    split: str = "heldout",
    file: str | None = None,
    checkpoint: str | None = None,
    data_path: str | None = None,
    threads: int | None = None,
    max_sentences: int = 0,
    stream: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    if max_sentences < 0:
        raise InputError("max_sentences must be >= 0 (0: all)", field="max_sentences")
    set_threads(threads)
    cfg, corpus, model, meta = load_run(run_dir, checkpoint, data_path)
    if file:
        sents, extra = corpus.encode_file(file)
        if extra:
            model.set_char_table(corpus.char_table(cfg.model.max_chars_per_token, extra))
        source = str(file)
    else:
        data = corpus.split(split)
        if len(data) == 0:
            raise InputError(f"split {split!r} is empty", field="split")
        sents = [np.asarray(data.sentence(i)) for i in range(len(data))]
        source = f"split:{split}"
    if max_sentences:
        sents = sents[:max_sentences]
    device = pick_device(cfg.train.device)
    model.to(device)
    res = (stream_perplexity if stream else perplexity)(
        model, corpus, sents, device, progress=progress
    )
    return {"source": source, **meta, **res}
