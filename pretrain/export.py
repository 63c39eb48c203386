"""`elmo-pretrain export`: a run's checkpoint as a serving artifact, or as a whole LM.

* :func:`export`: the biLM and tokenizer as an ``elmo_service`` artifact (no softmax,
  no optimizer state), with provenance: the run, its config, the corpus and its
  sources, and the held-out perplexity at export;
* :func:`export_lm` (``--lm``): biLM + softmax + the corpus's vocabulary, so that
  ``elmo-pretrain eval OUT --file ...`` works without the run folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from elmo_pretrain.checkpoint import describe_nonfinite, nonfinite_tensors
from elmo_pretrain.evaluate import load_run, perplexity
from elmo_pretrain.run_dir import LM_WEIGHTS, RUN_FILE
from elmo_pretrain.tracking import json_safe
from elmo_service.artifact import atomic_dir, save_artifact
from elmo_service.errors import InputError
from elmo_service.runtime import set_threads
from elmo_service.scalar_mix import MixSpec
from elmo_service.selftest import write_selftest


def _portable(path: str | Path) -> str:
    """A path as committed provenance should show it: relative to the working
    directory when below it, else just its name (no machine-specific prefixes)."""
    rel = os.path.relpath(path, Path.cwd())
    return rel if not rel.startswith("..") else Path(path).name


def _source_manifest(inputs: list[str]) -> dict[str, Any] | None:
    """The ``fetch-corpus`` manifest (sources, licences, sha256) next to the inputs, if any."""
    for folder in sorted({Path(p).parent for p in inputs}):
        m = folder / "manifest.json"
        if m.is_file():
            try:
                return json.loads(m.read_text())
            except (OSError, ValueError):
                return None
    return None


def refuse_nonfinite(model: torch.nn.Module, meta: dict[str, Any]) -> None:
    """A model with NaN or infinite weights is never exported (its vectors would be NaN)."""
    state = model.state_dict()
    if bad := nonfinite_tensors(state):
        raise InputError(
            f"{meta['checkpoint']} (step {meta['step']}) is not exported: "
            f"{describe_nonfinite(bad, len(state))}; export an earlier checkpoint (--checkpoint)",
            field="checkpoint",
        )


def export(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | None = None,
    data_path: str | None = None,
    evaluate_heldout: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    provenance_extra: dict[str, Any] | None = None,
    tasks: dict[str, MixSpec] | None = None,
) -> dict[str, Any]:
    """Write a serving artifact (BiLM + tokenizer; no softmax, no optimizer state) with provenance
    (``provenance_extra``: more of it, e.g. ``adapt``'s perplexities before and after) and
    ``tasks`` (``adapt``: the base model's task mixes), all in one atomic write."""
    set_threads(threads)
    cfg, corpus, model, meta = load_run(run_dir, checkpoint, data_path)
    refuse_nonfinite(model, meta)
    inputs = [i["path"] for i in corpus.manifest.get("inputs", {}).get("train", [])]
    provenance: dict[str, Any] = {
        "trainer": "elmo-pretrain",
        "run": _portable(run_dir),
        **meta,
        "directions": cfg.train.directions,
        "training_config": cfg.to_dict(),
        "corpus": {
            "params_hash": corpus.manifest.get("params_hash"),
            "summary": corpus.manifest.get("summary"),
            "inputs": [_portable(p) for p in inputs],
            "sources": _source_manifest(inputs),
            "tokenizer": corpus.manifest.get("tokenizer"),
            "vocab_size": corpus.manifest["vocab"]["softmax_size"],
        },
    }
    if evaluate_heldout and len(corpus.split("heldout")):
        data = corpus.split("heldout")
        sents = [np.asarray(data.sentence(i)) for i in range(len(data))]
        ev = perplexity(model, corpus, sents, torch.device("cpu"), progress=progress)
        if not all(math.isfinite(v) for k, v in ev.items() if k.endswith("ppl")):
            raise InputError(
                f"{meta['checkpoint']} (step {meta['step']}) is not exported: its held-out "
                f"perplexity is not finite (forward mean NLL {ev['forward_nll']:.4g} nats), the "
                "run diverged; export an earlier checkpoint (--checkpoint)",
                field="checkpoint",
            )
        provenance["heldout"] = json_safe(ev)
    provenance.update(provenance_extra or {})
    if cfg.train.directions == "forward":
        provenance["warning"] = "forward-only LM: the backward LSTM layers were never trained"
    version = save_artifact(
        model.bilm,
        corpus.load_tokenizer(),
        out,
        provenance=provenance,
        tasks=tasks,
        overwrite=overwrite,
    )
    write_selftest(out)  # fixed sentences and their vectors: GET /v1/selftest checks a server
    return {
        "out": str(out),
        "version": version,
        **meta,
        "heldout": provenance.get("heldout"),
        "warning": provenance.get("warning"),
    }


def export_lm(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | None = None,
    data_path: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """The whole language model, softmax included, for re-evaluation anywhere.

    ``out/lm.safetensors`` (biLM + softmax), ``out/run.json`` (the training
    config, pointing at ``out/corpus``) and ``out/corpus/`` (the prepared
    corpus's manifest, vocabulary and tokenizer, without its shards), so that
    ``elmo-pretrain eval OUT --file test.txt`` works without the run folder.
    """
    cfg, corpus, model, meta = load_run(run_dir, checkpoint, data_path)
    refuse_nonfinite(model, meta)
    out = Path(out)
    with atomic_dir(out, overwrite) as tmp:
        state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / LM_WEIGHTS), metadata={"format": "elmo-pretrain-lm"})
        (tmp / "corpus").mkdir()
        manifest = dict(corpus.manifest, shards={}, inputs={})
        (tmp / "corpus" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for name in (corpus.manifest["vocab"]["file"], "tokenizer.model"):
            if (corpus.path / name).is_file():
                shutil.copy(corpus.path / name, tmp / "corpus" / name)
        config = cfg.to_dict()
        config["data"]["path"] = "corpus"
        info = {"format": "elmo-pretrain-lm", "config": config, "lm": meta}
        (tmp / RUN_FILE).write_text(json.dumps(info, indent=2) + "\n")
    size = (out / LM_WEIGHTS).stat().st_size
    return {"out": str(out), "bytes": size, **meta}
