"""A model's self-test: fixed sentences and their vectors, stored with the artifact.

At export (``pretrain/export.py``, ``elmo-service convert``) :func:`write_selftest`
runs the new artifact on :data:`SENTENCES` (eight, of 1 to ~40 words), each alone,
on the CPU in fp32, and stores beside it::

    selftest.safetensors  one [L+1, T, D] float32 tensor per sentence ("s0" ... "s7")
    selftest.json         the sentences, their model tokens, the bound, the model
                          version and the sha256 of selftest.safetensors

They are not in the manifest (like ``tasks/``): the model version, and every cache key
made from it, stay what they were. ``selftest.json`` is written last and names the
tensors file's hash, so a half-copied pair reads as absent or corrupt, never as a pass.

A server runs the served model on the stored tokens, alone and batched, and compares
with :func:`compare`: every value within ``1e-5 x max(1, |stored value|)`` (the
project's statelessness bound, docs/reliability.md). Only the fp32 serving path is
held to it; bf16 / fp16 / int8 modes are reported without a verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elmo_service import atomic
from elmo_service.artifact import read_manifest
from elmo_service.atomic import sha256_file
from elmo_service.errors import ArtifactError

VECTORS, META = "selftest.safetensors", "selftest.json"
FORMAT = "elmo-service-selftest"
# the bound every stored value is held to: |served - stored| <= REL_BOUND x max(1, |stored|)
REL_BOUND = 1e-5

# varied lengths (1 to 41 words), punctuation, digits, casing, a repeated word: the padded
# positions of a batch and both directions' ends are exercised
SENTENCES = [
    "Hello .",
    "The bank raised its rates again .",
    "We sat on the river bank and watched the boats go by .",
    "Yes",
    "In 1998 , the committee met 12 times ; its report ran to 300 pages .",
    "Time flies like an arrow ; fruit flies like a banana .",
    "She said that the old city walls , which had stood for centuries , would be repaired "
    "by the new council before the long winter set in , and that the work would cost far "
    "more than anyone had expected at first .",
    "Buffalo buffalo Buffalo buffalo buffalo buffalo Buffalo buffalo .",
]


@dataclass
class SelfTest:
    """The stored sentences' model tokens and their vectors."""

    tokens: list[list[str]]
    vectors: list[np.ndarray]
    meta: dict[str, Any]


def write_selftest(directory: str | Path, embedder: Any = None) -> dict[str, Any]:
    """Compute and store the self-test of the artifact in ``directory`` (see the module
    docstring); ``embedder``: one already loaded from it (else it is loaded, on the CPU,
    fp32). Returns what ``selftest.json`` holds."""
    directory = Path(directory)
    if embedder is None:
        from elmo_service.embedder import Embedder  # here: the service imports this module

        embedder = Embedder.load(directory, device="cpu", token_cache_size=0)
    # the model's tokens (a small sentencepiece vocabulary splits the long sentence into
    # more pieces than a small model takes: cut to its limit; the check runs tokens anyway)
    limit = embedder.max_sentence_tokens
    tokens = [[t.piece for t in embedder.tokenizer(s)][:limit] for s in SENTENCES]
    vectors = [embedder.run_batch([toks])[0] for toks in tokens]  # each alone
    tensors = {f"s{i}": torch.from_numpy(np.ascontiguousarray(v)) for i, v in enumerate(vectors)}
    with atomic.atomic_path(directory / VECTORS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "schema_version": 1,
        "model_version": read_manifest(directory).get("version"),
        "sentences": SENTENCES,
        "tokens": tokens,
        "bound": {"relative": REL_BOUND, "rule": "|served - stored| <= 1e-5 x max(1, |stored|)"},
        "computed_with": {"device": "cpu", "precision": "fp32", "alone": True},
        "vectors_sha256": sha256_file(directory / VECTORS),
    }
    atomic.write_json(directory / META, meta, indent=2, sort_keys=True)
    return meta


def load_selftest(directory: str | Path) -> SelfTest | None:
    """The stored self-test, or None when the artifact has none; ArtifactError when it is
    corrupt (the tensors file does not match the hash ``selftest.json`` names)."""
    directory = Path(directory)
    if not (directory / META).is_file():
        return None
    try:
        meta = json.loads((directory / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"corrupt {META}: {e}", field=META) from e
    path = directory / VECTORS
    if not path.is_file() or sha256_file(path) != meta.get("vectors_sha256"):
        raise ArtifactError(f"{VECTORS} does not match the hash in {META}", field=VECTORS)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"corrupt {VECTORS}: {e}", field=VECTORS) from e
    tokens = meta.get("tokens")
    if not isinstance(tokens, list) or len(tensors) != len(tokens):
        raise ArtifactError(f"{META} and {VECTORS} disagree on the sentences", field=META)
    vectors = [tensors[f"s{i}"].numpy() for i in range(len(tokens))]
    return SelfTest(tokens=tokens, vectors=vectors, meta=meta)


def compare(stored: list[np.ndarray], served: list[np.ndarray]) -> dict[str, Any]:
    """The largest absolute difference, the largest difference relative to the bound's
    scale (``|d| / max(1, |stored|)``), and whether every value is within the bound."""
    worst_abs, worst_rel, worst_at = 0.0, 0.0, None
    for i, (want, got) in enumerate(zip(stored, served, strict=True)):
        if want.shape != got.shape:
            return {
                "max_abs_diff": math.inf,
                "max_rel_diff": math.inf,
                "worst_sentence": i,
                "within_bound": False,
                "error": f"sentence {i}: shape {list(got.shape)}, stored {list(want.shape)}",
            }
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        if not np.isfinite(diff).all():
            return {
                "max_abs_diff": math.inf,
                "max_rel_diff": math.inf,
                "worst_sentence": i,
                "within_bound": False,
                "error": f"sentence {i}: non-finite values",
            }
        rel = diff / np.maximum(1.0, np.abs(want.astype(np.float64)))
        a, r = float(diff.max(initial=0.0)), float(rel.max(initial=0.0))
        if r > worst_rel or worst_at is None:
            worst_at = i
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
    return {
        "max_abs_diff": worst_abs,
        "max_rel_diff": worst_rel,
        "worst_sentence": worst_at,
        "within_bound": worst_rel <= REL_BOUND,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m elmo_service.selftest DIR...``: (re)write the self-test of existing
    artifacts (how the bundled ``models/default`` got its own; the manifest is untouched)."""
    import sys

    for d in (sys.argv[1:] if argv is None else argv) or ["models/default"]:
        meta = write_selftest(d)
        print(f"{d}: {len(meta['sentences'])} sentences, model {meta['model_version']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
