"""``finetune --adapt`` (the ELMo paper's §3.4): continue the biLM on the task's own text first.

The task's training and dev text, never its test text, is written one sentence a
line and handed to :mod:`elmo_pretrain.adapt`; the adapted model is kept under the
finetune cache, keyed by the model's version, that text and the adaptation's
options, so the processes a benchmark splits its seeds over share one adaptation
(and a rerun reuses it) instead of each training its own.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from elmo_pretrain.probe.features import fingerprint
from elmo_service import atomic

Log = Callable[[str], None]
RECORD = "adaptation.json"  # what the adaptation measured, beside the adapted model


def task_text(data: dict[str, list[tuple]], tokens: bool) -> list[str]:
    """The training and dev text, one sentence a line; the test split is never read."""
    rows = [*data["train"], *data["dev"]]
    return [" ".join(words) for words, _ in rows] if tokens else [text for text, _ in rows]


def adapted_model(
    model_dir: Path,
    version: str,
    data: dict[str, list[tuple]],
    tokens: bool,
    cache_dir: Path,
    options: dict,
    threads: int | None = None,
    log: Log = print,
) -> tuple[Path, dict]:
    """The model adapted to the task's text (trained now, or found in the cache) and the
    adaptation's record: perplexities before and after, its time, the text's size."""
    text = task_text(data, tokens)
    key = fingerprint([version, text, sorted(options.items())])  # threads change no result
    folder = cache_dir / "adapted" / key
    record_path = folder / RECORD
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        log(f"[adapt] reusing the adapted model in {folder}")
        return folder / "model", {**record, "reused": True}
    log(
        f"[adapt] continuing {model_dir} on the task's training and dev text "
        f"({len(text):,} sentences)"
    )
    t0 = time.monotonic()
    with atomic.atomic_dir(folder) as tmp:
        corpus = tmp / "corpus.txt"
        atomic.write_text(corpus, "".join(line + "\n" for line in text))
        measured = run_adaptation(model_dir, corpus, tmp, options, threads, log)
        record = {
            "model": str(folder / "model"),
            "sentences": len(text),
            **measured,
            "seconds": round(time.monotonic() - t0, 1),
            "options": options,
        }
        atomic.write_json(tmp / RECORD, record, indent=2)
    return folder / "model", {**record, "reused": False}


def run_adaptation(
    model_dir: Path, corpus: Path, folder: Path, options: dict, threads: int | None, log: Log
) -> dict:
    """``elmo_pretrain.adapt.adapt`` on ``corpus`` (one sentence a line) into ``folder/model``;
    its work folder (prepared corpus, checkpoints) is dropped once the model is written."""
    from elmo_pretrain.adapt import AdaptOptions, adapt
    from elmo_pretrain.data import Corpus

    work = folder / "work"
    opts = AdaptOptions(
        **options, split="none", threads=threads or 0, progress=False, work_dir=str(work)
    )
    # Ctrl-C: adapt checkpoints, then hands the signal on; the cache's folder is dropped whole
    res = adapt(model_dir, [str(corpus)], folder / "model", opts, log=log)
    if not res.exported or res.heldout_after is None:
        raise RuntimeError(f"adapt stopped at step {res.step} ({res.stopped}) without a model")
    heldout = len(Corpus(Path(res.work_dir) / "corpus").split("heldout"))
    shutil.rmtree(work)

    def ppl(ev: dict | None) -> float | None:
        return None if ev is None else round(float(ev["avg_ppl"]), 2)

    return {
        "heldout_sentences": heldout,
        "steps": res.step,
        "stopped": res.stopped,
        "softmax": res.softmax,
        "perplexity_before": ppl(res.heldout_before),
        "perplexity_after": ppl(res.heldout_after),
        "original_perplexity_before": ppl(res.forgetting_before),
        "original_perplexity_after": ppl(res.forgetting_after),
        "adapted_version": res.version,
    }
