"""The biLM's contract: shapes, statelessness, no leaks across padding or direction."""

import numpy as np
import pytest
import torch

from elmo_service.bilm.char_ids import batch_ids
from elmo_service.bilm.model import reverse_padded
from tests.support.core_fixtures import tiny_model

SENTS = [
    ["the", "bank", "of", "the", "river"],
    ["a"],
    ["money", "flows", "near", "the", "old", "stone", "bridge", "every", "morning"],
    ["boats", "sail"],
]


def run(model, sents):
    ids, lengths = batch_ids(sents, model.cfg.max_chars_per_token)
    with torch.inference_mode():
        return model(torch.from_numpy(ids), torch.from_numpy(lengths)), lengths


def test_output_shape_and_layer0_duplicates_token_vector():
    model = tiny_model()
    out, lengths = run(model, SENTS)
    p = model.cfg.projection_dim
    assert out.shape == (model.cfg.n_layers + 1, len(SENTS), int(lengths.max()), 2 * p)
    torch.testing.assert_close(out[0, ..., :p], out[0, ..., p:])
    # padding positions are zero in every layer
    assert out[:, 1, 3:].abs().max() == 0


def test_stateless_alone_in_batch_and_again():
    model = tiny_model()
    batch, lengths = run(model, SENTS)
    for i, s in enumerate(SENTS):
        alone, _ = run(model, [s])
        n = lengths[i]
        assert (alone[:, 0, :n] - batch[:, i, :n]).abs().max() <= 1e-5
    again, _ = run(model, SENTS)
    assert torch.equal(batch, again)


def test_directions_see_only_their_side():
    model = tiny_model()
    p = model.cfg.projection_dim
    base, _ = run(model, [SENTS[2]])
    changed = list(SENTS[2])
    k = 4  # token index; +1 for <S> in the output positions
    changed[k] = "zebra"
    alt, _ = run(model, [changed])
    pos = k + 1
    for layer in range(1, model.cfg.n_layers + 1):
        fwd_diff = (base[layer, 0, :, :p] - alt[layer, 0, :, :p]).abs().amax(-1)
        bwd_diff = (base[layer, 0, :, p:] - alt[layer, 0, :, p:]).abs().amax(-1)
        assert fwd_diff[:pos].max() == 0 and fwd_diff[pos:].max() > 0
        assert bwd_diff[pos + 1 :].max() == 0 and bwd_diff[: pos + 1].max() > 0


def test_padding_content_never_leaks():
    model = tiny_model()
    ids, lengths = batch_ids(SENTS, model.cfg.max_chars_per_token)
    ids_t, len_t = torch.from_numpy(ids), torch.from_numpy(lengths)
    garbage = ids_t.clone()
    for b, n in enumerate(lengths):
        garbage[b, n:] = torch.randint(1, 262, garbage[b, n:].shape)
    with torch.inference_mode():
        a, b = model(ids_t, len_t), model(garbage, len_t)
    assert torch.equal(a, b)


def test_backward_direction_starts_at_last_real_token():
    # The backward state at a sentence's last token must equal the backward
    # state computed for that sentence alone, whatever the batch width.
    model = tiny_model()
    p = model.cfg.projection_dim
    batch, lengths = run(model, SENTS)
    alone, _ = run(model, [SENTS[1]])
    n = lengths[1]
    np.testing.assert_allclose(batch[-1, 1, n - 1, p:], alone[-1, 0, n - 1, p:], atol=1e-6)


def test_reverse_padded_is_an_involution():
    x = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)
    lengths = torch.tensor([4, 2])
    r = reverse_padded(x, lengths)
    assert r[1, :, 0].tolist() == [5.0, 4.0, 6.0, 7.0]
    assert torch.equal(reverse_padded(r, lengths), x)


@pytest.mark.parametrize("residual", [True, False])
def test_residual_connection_changes_output(residual):
    a = tiny_model(residual=residual)
    b = tiny_model(residual=not residual)
    out_a, _ = run(a, SENTS[:1])
    out_b, _ = run(b, SENTS[:1])
    torch.testing.assert_close(out_a[:2], out_b[:2])  # layers 0 and 1 have no skip
    assert (out_a[2] - out_b[2]).abs().max() > 1e-3


def test_clipping_bounds_hidden_states():
    model = tiny_model(proj_clip=0.05, residual=False)
    out, _ = run(model, SENTS)
    assert out[1:].abs().max() <= 0.05 + 1e-7


def test_the_model_imports_no_kernel():
    """model.py is plain torch: training and the GPU path never load numba or the CPU kernels
    (the embedder imports them when it chooses them)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, elmo_service.bilm.model, elmo_service.bilm.lstm, elmo_service.bilm.kernels.select; "
        "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith('elmo_service.bilm.kernels.')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # tuning: constants only (the process setup reads them); select: the choice, no kernel
    assert (
        out.stdout.strip()
        == "['elmo_service.bilm.kernels.select', 'elmo_service.bilm.kernels.tuning']"
    )
