"""Every path the model runs in computes the one reference's function, and a sentence gets
the same vectors in a batch as alone (the TEI pattern: every kernel through the public calls
against one reference).

Paths, each selected by constructing it: the training kernel (``BiLM`` under autograd:
``Conv1d`` filters, ``LstmpFunction``), the model's torch inference (``TorchBiLM``: table
lookups, ``run_direction``), the CPU kernel batched and on one sentence (``CpuBiLM``:
native filters, packed weights, the batched cell; numba's row loop), and its int8 weights.
The reference (``tests/support/reference.py``) runs in float64.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from elmo_service.bilm.char_ids import batch_ids
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.kernels.select import TorchBiLM
from elmo_service.bilm.lstm import LstmpFunction
from elmo_service.bilm.model import BiLM
from tests.support.core_fixtures import tiny_model
from tests.support.reference import reference_bilm

SENTENCES = [
    ["The", "bank", "of", "the", "river", "."],
    ["Money"],
    [],
    ["a", "long-token-that-gets-cut-at-the-byte-limit-of-the-model", "café", "!"],
    ["the", "old", "stone", "bridge", "over", "the", "river", "bank", "every", "morning"],
]
FP32_TOL = 1e-5  # float32 paths against the float64 reference, and batch against alone


def random_bilm(**overrides) -> BiLM:
    """Weights at a scale where every layer carries signal and the clips bite."""
    filters = ((1, 4), (2, 8), (3, 8), (5, 6))
    return tiny_model(filters=filters, cell_clip=0.8, proj_clip=0.5, **overrides)


def run_training_kernel(model: BiLM, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    model.train()
    model.dropout.p = 0.0
    runs = []
    real_apply = LstmpFunction.apply

    def fused(*args):
        runs.append(args[-1])  # the rows still active per step: padding skipped, not run
        return real_apply(*args)

    LstmpFunction.apply = fused
    try:
        out = model(ids, lengths)  # autograd on: Conv1d filters, LstmpFunction
        assert out.requires_grad
        # the fused kernel ran for every layer and direction, on the sorted batch
        assert len(runs) == 2 * model.cfg.n_layers and all(r is not None for r in runs)
        return out.detach()
    finally:
        LstmpFunction.apply = real_apply
        model.eval()


def run_kernel(kernel, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    b, t, w = ids.shape
    with torch.inference_mode():
        tokens = kernel.encode(ids.reshape(b * t, w)).reshape(b, t, -1)
        return kernel.contextualize(tokens, lengths)


PATHS = {
    "training kernel": lambda model: lambda ids, n: run_training_kernel(model, ids, n),
    "torch inference": lambda model: lambda ids, n: run_kernel(TorchBiLM(model), ids, n),
    "cpu fp32": lambda model: lambda ids, n: run_kernel(CpuBiLM(model), ids, n),
    "cpu int8": lambda model: lambda ids, n: run_kernel(CpuBiLM(model, weights="int8"), ids, n),
}


@pytest.mark.parametrize("overrides", [{}, {"activation": "tanh", "residual": False}])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_computes_the_reference_in_a_batch_and_alone(monkeypatch, path, overrides):
    import elmo_service.bilm.kernels.tuning as tuning

    monkeypatch.setattr(tuning, "INT8_MIN_ELEMENTS", 0)  # int8 on the tiny model's matrices
    model = random_bilm(**overrides)
    run = PATHS[path](model)
    w = model.cfg.max_chars_per_token
    ids, lengths = batch_ids(SENTENCES, w)
    together = run(torch.from_numpy(ids), torch.from_numpy(lengths))
    tol = 0.03 if path == "cpu int8" else FP32_TOL  # int8: the weights' 8 bits
    for b, sent in enumerate(SENTENCES):
        n = len(sent) + 2
        ref = reference_bilm(model, sent, dtype=torch.float64).float()
        got = together[:, b, :n]
        scale = float(ref.abs().max())
        assert (got - ref).abs().max() <= tol * (scale if path == "cpu int8" else 1), path
        assert not together[:, b, n:].any()  # padding is zero in every layer
        one_ids, one_len = batch_ids([sent], w)
        alone = run(torch.from_numpy(one_ids), torch.from_numpy(one_len))[:, 0]
        assert (alone - got).abs().max() <= FP32_TOL, "batch != alone"
    if path == "cpu int8":  # and int8 really ran
        fp32 = PATHS["cpu fp32"](model)(torch.from_numpy(ids), torch.from_numpy(lengths))
        assert (together - fp32).abs().max() > 1e-4


def test_the_embedder_chooses_its_kernel_once_and_logs_it(tiny_model_dir, caplog):
    from elmo_service.embedder import Embedder

    with caplog.at_level(logging.INFO, logger="elmo_service.embedder"):
        fp32 = Embedder.load(tiny_model_dir, threads=1, device="cpu")
        bf16 = Embedder.load(tiny_model_dir, threads=1, device="cpu", precision="bf16")
    assert fp32.kernel_name == "cpu-native fp32" and isinstance(fp32.kernel, CpuBiLM)
    assert bf16.kernel_name == "torch" and isinstance(bf16.kernel, TorchBiLM)
    logged = [r.getMessage() for r in caplog.records]
    assert "kernel: cpu-native fp32" in logged and "kernel: torch" in logged
    fp32.warm_up()  # compiles the native kernels, runs a batch and a sentence alone
    bf16.warm_up()
    # the embedder's answer is the kernel's, batch and alone
    sents = [["the", "bank"], ["river"], ["the", "old", "bridge", "."]]
    together = fp32.embed_tokens(sents)
    for s, got in zip(sents, together, strict=True):
        ref = reference_bilm(fp32.model, s, dtype=torch.float64).float()[:, 1:-1].numpy()
        assert np.abs(got - ref).max() <= FP32_TOL
        assert np.abs(fp32.embed_tokens([s])[0] - got).max() <= FP32_TOL
