"""The one LSTM layer: its training kernel equals autograd, and training runs the served model."""

import torch

from elmo_service.bilm.lstm import LstmLayer, LstmpFunction
from elmo_service.bilm.model import BiLM
from tests.support.configs import small_test_config
from tests.support.reference import lstmp_step


def ref_layer(x_gates, w_hh_t, w_proj_t, h, c, keep, clip):
    """Plain autograd through the reference's step loop (tests/support/reference.py)."""
    outs = []
    for s in range(x_gates.shape[1]):
        if keep is not None:
            h, c = h * keep[:, s, None], c * keep[:, s, None]
        h, c = lstmp_step(x_gates[:, s], h, c, w_hh_t.t(), w_proj_t.t(), clip, clip)
        outs.append(h)
    return torch.stack(outs, 1), c


def test_fused_kernel_matches_autograd_with_state_and_resets():
    torch.manual_seed(0)
    b, t, c, p = 3, 7, 6, 4
    x_gates = (2 * torch.randn(b, t, 4 * c)).requires_grad_()
    w_hh = (torch.randn(p, 4 * c) / 2).requires_grad_()
    w_proj = torch.randn(c, p).requires_grad_()
    h0 = torch.randn(b, p).requires_grad_()
    c0 = torch.randn(b, c).requires_grad_()
    keep = torch.ones(b, t)
    keep[0, 3] = keep[2, 0] = 0.0  # resets mid-window and at the first step
    clip = 1.0  # small: both clips are active somewhere
    for k in (None, keep):
        out, cs = LstmpFunction.apply(x_gates, w_hh, w_proj, h0, c0, k, clip, clip)
        ref, ref_c = ref_layer(x_gates, w_hh, w_proj, h0, c0, k, clip)
        assert torch.allclose(out, ref, atol=1e-6)
        assert torch.allclose(cs[:, -1], ref_c, atol=1e-6)
        assert (ref.abs() == clip).any()
        g = torch.randn_like(out)
        inputs = (x_gates, w_hh, w_proj, h0, c0)
        grads = torch.autograd.grad((out * g).sum(), inputs)
        ref_grads = torch.autograd.grad((ref * g).sum(), inputs)
        for a, r in zip(grads, ref_grads, strict=True):
            assert torch.allclose(a, r, atol=1e-5), (a - r).abs().max()
    # a frozen projection (a plain LSTM's identity) gets no gradient; the rest are unchanged
    eye = torch.eye(c, p)
    out, _ = LstmpFunction.apply(x_gates, w_hh, eye, h0, c0, keep, clip, clip)
    ref, _ = ref_layer(x_gates, w_hh, eye, h0, c0, keep, clip)
    inputs = (x_gates, w_hh, h0, c0)
    grads = torch.autograd.grad(out.sum(), inputs)
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    for a, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, r, atol=1e-5), (a - r).abs().max()
    # a reset at step 0 cuts row 2 off its initial state entirely
    out, _ = LstmpFunction.apply(x_gates, w_hh, w_proj, h0, c0, keep, clip, clip)
    (gh0,) = torch.autograd.grad(out.sum(), h0)
    assert gh0[2].abs().max() == 0 and gh0[1].abs().max() > 0


def test_training_and_inference_kernels_agree_on_a_layer():
    """The same LstmLayer, with and without autograd, from a carried state."""
    torch.manual_seed(1)
    cfg = small_test_config()
    layer = LstmLayer(cfg.projection_dim, cfg)
    x = torch.randn(4, 9, cfg.projection_dim)
    state = (torch.randn(4, cfg.projection_dim), torch.randn(4, cfg.lstm_dim))
    keep = torch.ones(4, 9)
    keep[1, 4] = 0
    train_out, (th, tc) = layer(x, state, keep=keep)
    assert train_out.requires_grad  # the fused kernel ran
    with torch.no_grad():
        infer_out, (ih, ic) = layer(x, state, keep=keep)
    assert torch.allclose(train_out, infer_out, atol=1e-5)
    assert torch.allclose(th, ih, atol=1e-5) and torch.allclose(tc, ic, atol=1e-5)
    # carrying the state across two halves equals one pass
    with torch.no_grad():
        a, st = layer(x[:, :5], state, keep=keep[:, :5])
        b, _ = layer(x[:, 5:], st, keep=keep[:, 5:])
    assert torch.allclose(torch.cat([a, b], 1), infer_out, atol=1e-6)


def test_language_model_runs_the_served_bilm():
    """Sentence-mode LM hidden states are the served model's top layer, trained kernel or not."""
    from types import SimpleNamespace

    from elmo_pretrain.lm import LanguageModel

    torch.manual_seed(2)
    cfg = small_test_config(dropout=0.0)
    sm = SimpleNamespace(kind="full", n_samples=8192, cutoffs=(), div_value=4.0)
    lm = LanguageModel(cfg, sm, 20, torch.zeros(20, cfg.max_chars_per_token, dtype=torch.int32))
    bilm: BiLM = lm.bilm
    tokens = torch.randn(3, 6, cfg.projection_dim)
    lengths = torch.tensor([6, 4, 2])
    h_f, h_b = lm.hidden(tokens, lengths)  # grad on: the fused training kernel
    assert h_f.requires_grad
    with torch.no_grad():
        served = bilm.contextualize(tokens, lengths)[-1]  # [B, T, 2P]
    p = cfg.projection_dim
    mask = (torch.arange(6)[None] < lengths[:, None])[..., None]
    assert torch.allclose((h_f * mask).detach(), served[..., :p], atol=1e-5)
    assert torch.allclose((h_b * mask).detach(), served[..., p:], atol=1e-5)


def test_compiled_steps_are_per_model_not_a_process_wide_swap():
    from elmo_service.bilm.lstm import EAGER_STEPS, compiled_steps

    compiled, plain = BiLM(small_test_config()), BiLM(small_test_config())
    compiled.use_compiled_steps()  # torch.compile is lazy: nothing compiles here
    layers = [*compiled.forward_layers, *compiled.backward_layers]
    assert all(layer.steps is compiled_steps() for layer in layers)
    assert compiled_steps().forward is not EAGER_STEPS.forward
    assert all(
        layer.steps is EAGER_STEPS for layer in (*plain.forward_layers, *plain.backward_layers)
    )
