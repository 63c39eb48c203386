"""The CPU kernel (elmo_service/bilm/kernels: CpuBiLM, bilstm.py, packed.py) gives the numbers of
the model's torch path: threads, the single-sentence loop, distinct tokens, int8, weight updates."""

import copy
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import elmo_service.bilm.kernels.bilstm as bilstm
import elmo_service.bilm.kernels.tuning as tuning
from elmo_service.bilm.kernels.certificate import SENTENCES
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.kernels.native_rounded import round_weight
from elmo_service.bilm.kernels.packed import PackedLinear
from elmo_service.bilm.model import BiLM, length_mask
from elmo_service.embedder import Embedder
from elmo_service.errors import ConfigError
from tests.support.configs import small_test_config
from tests.support.core_fixtures import tiny_artifact
from tests.support.reference import char_cnn as ref_char_cnn

TOL = 1e-5


def random_bilm(seed: int = 0, **overrides) -> BiLM:
    """A tiny model with weights at a scale where gates are not saturated and clips bite."""
    torch.manual_seed(seed)
    cfg = small_test_config(lstm_dim=32, projection_dim=16, cell_clip=0.8, proj_clip=0.5)
    cfg = cfg.replace(**overrides)  # BiLMConfig is immutable
    model = BiLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def plain(model: BiLM, tokens, lengths) -> torch.Tensor:
    """The model's own torch path (``run_direction`` per direction)."""
    with torch.inference_mode():
        return model.contextualize(tokens, lengths)


def fast(model: BiLM, tokens, lengths, weights="fp32") -> torch.Tensor:
    with torch.inference_mode():
        return CpuBiLM(model, weights=weights).contextualize(tokens, lengths)


def batch(b: int, t: int, p: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(b, t, p, generator=g)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[b // 2] = t
    return tokens, lengths


@pytest.mark.parametrize("b", [1, 2, 7])
def test_kernel_equals_plain_path(b):
    model = random_bilm()
    tokens, lengths = batch(b, 9, model.cfg.projection_dim)
    want, got = plain(model, tokens, lengths), fast(model, tokens, lengths)
    assert got.shape == want.shape
    assert (want[1].abs() >= model.cfg.proj_clip - 1e-6).any()  # the clip was exercised
    assert (got - want).abs().max() <= TOL
    # padding stays zero
    for r, n in enumerate(lengths.tolist()):
        assert (got[:, r, n:] == 0).all()


def test_padding_past_every_length_and_empty_rows():
    model = random_bilm()
    p = model.cfg.projection_dim
    for lengths in (torch.tensor([4]), torch.tensor([5, 0, 3])):
        tokens = torch.randn(len(lengths), 7, p)  # T beyond the longest sentence
        got, want = fast(model, tokens, lengths), plain(model, tokens, lengths)
        assert (got - want).abs().max() <= TOL
        assert (got[:, :, 5:] == 0).all()


@pytest.mark.parametrize("residual,clips", [(False, True), (True, False)])
def test_kernel_without_residual_or_clips(residual, clips):
    extra = {} if clips else {"cell_clip": None, "proj_clip": None}
    model = random_bilm(residual=residual, **extra)
    tokens, lengths = batch(4, 6, model.cfg.projection_dim)
    assert (fast(model, tokens, lengths) - plain(model, tokens, lengths)).abs().max() <= TOL


@pytest.fixture
def two_threads(torch_threads):
    """Two torch threads, as a 2-core server runs: several rows split by direction."""
    torch_threads(2)


def spy_directions(monkeypatch, counts: list[int] | None = None) -> list[str]:
    """The names of the threads that run a direction's stack of layers (and, in
    ``counts``, the torch thread count each of them runs with)."""
    seen: list[str] = []
    real = bilstm.BiLstmKernel._direction_stack

    def spy(self, *args):
        seen.append(threading.current_thread().name)
        if counts is not None:
            counts.append(torch.get_num_threads())
        return real(self, *args)

    monkeypatch.setattr(bilstm.BiLstmKernel, "_direction_stack", spy)
    return seen


@pytest.mark.parametrize("mode", ["inference", "no_grad"])
@pytest.mark.parametrize("b", [2, 5])
def test_directions_on_two_threads_give_one_threads_numbers(two_threads, monkeypatch, mode, b):
    model = random_bilm()
    tokens, lengths = batch(b, 9, model.cfg.projection_dim)
    lengths[-1] = 0  # an empty row too
    counts: list[int] = []
    seen = spy_directions(monkeypatch, counts)
    guard = torch.inference_mode if mode == "inference" else torch.no_grad
    with guard():
        split = CpuBiLM(model).contextualize(tokens, lengths)
    # one task per direction on the pool (a tiny model's first may end before the second starts)
    assert len(seen) == 2 and all(name.startswith("elmo-bilstm") for name in seen)
    assert counts == [1, 1]  # half each: two threads in all, not two OpenMP teams
    monkeypatch.setattr(tuning, "SPLIT_MIN_ROWS", 1 << 30)
    caller = fast(model, tokens, lengths)
    assert seen[2:] == [threading.current_thread().name] * 2  # one direction after the other
    assert (split - caller).abs().max() <= 1e-6
    assert (split - plain(model, tokens, lengths)).abs().max() <= TOL
    assert (split[:, -1] == 0).all()
    # the workers' own thread count does not leak into the caller or into threads started later
    assert torch.get_num_threads() == 2
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]


def spy_native(monkeypatch) -> list[str]:
    """The names of the threads that run the native single-sentence loop, one per layer
    and direction."""
    seen: list[str] = []
    real = bilstm.lstmp_row

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(bilstm, "lstmp_row", spy)
    return seen


def test_other_thread_counts_keep_the_directions_on_the_caller(monkeypatch, two_threads):
    model = random_bilm()
    seen, native = spy_directions(monkeypatch), spy_native(monkeypatch)
    for threads in (1, 4):  # one: nothing to split; four: two OpenMP teams beside the caller's
        torch.set_num_threads(threads)
        tokens, lengths = batch(4, 6, model.cfg.projection_dim)
        fast(model, tokens, lengths)
    assert seen == [threading.current_thread().name] * 4 and native == []


@pytest.mark.parametrize("threads", [1, 2])
def test_one_sentence_runs_the_native_loop(monkeypatch, torch_threads, threads):
    """Each direction's layers in numba (GIL released): on the two workers with two
    threads, on the caller with one. Same numbers as the plain path, every call alike."""
    torch_threads(threads)
    model = random_bilm()
    native = spy_native(monkeypatch)
    tokens, lengths = batch(1, 9, model.cfg.projection_dim)
    got = fast(model, tokens, lengths)
    n_layers = model.cfg.n_layers
    assert len(native) == 2 * n_layers
    if threads == 2:
        # (a tiny model's first direction may end before the second starts, on the same worker)
        assert all(name.startswith("elmo-bilstm") for name in native)
    else:
        assert set(native) == {threading.current_thread().name}
    want = plain(model, tokens, lengths)
    assert (want[1].abs() >= model.cfg.proj_clip - 1e-6).any()  # the clip was exercised
    assert (got - want).abs().max() <= TOL
    assert torch.equal(fast(model, tokens, lengths), got)
    assert torch.get_num_threads() == threads


def test_native_loop_on_an_empty_sentence_and_without_residual_or_clips():
    model = random_bilm()
    tokens = torch.randn(1, 5, model.cfg.projection_dim)
    assert (fast(model, tokens, torch.tensor([0])) == 0).all()
    model = random_bilm(residual=False, cell_clip=None, proj_clip=None)
    tokens, lengths = batch(1, 7, model.cfg.projection_dim)
    assert (fast(model, tokens, lengths) - plain(model, tokens, lengths)).abs().max() <= TOL


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
def test_a_sentence_gets_the_same_vectors_alone_and_in_any_batch(
    monkeypatch, torch_threads, weights, threads
):
    torch_threads(threads)
    _same_alone_and_in_any_batch(monkeypatch, weights)


def _same_alone_and_in_any_batch(monkeypatch, weights):
    monkeypatch.setattr(tuning, "INT8_MIN_ELEMENTS", 0)  # int8 on the tiny model's matrices
    model = random_bilm()
    tokens, lengths = batch(6, 8, model.cfg.projection_dim)
    together = fast(model, tokens, lengths, weights)
    for r in range(6):
        alone = fast(model, tokens[r : r + 1, : lengths[r]], lengths[r : r + 1], weights)
        assert (alone[:, 0] - together[:, r, : lengths[r]]).abs().max() <= TOL
    rev = torch.arange(5, -1, -1)
    shuffled = fast(model, tokens[rev], lengths[rev], weights)
    assert (shuffled - together[:, rev]).abs().max() <= TOL


def spy_gathers(monkeypatch) -> list[tuple[int, int]]:
    """(table rows, real rows) of every step-loop input that came from a table."""
    seen: list[tuple[int, int]] = []
    real = bilstm.BiLstmKernel._input_gates

    def spy(self, layer, d, x, rows, gather=None):
        out = real(self, layer, d, x, rows, gather)
        if out.index is not None:
            seen.append((out.gates.shape[0], out.index.shape[0]))
        return out

    monkeypatch.setattr(bilstm.BiLstmKernel, "_input_gates", spy)
    return seen


@pytest.mark.parametrize("threads", [1, 2])  # the directions on the caller / on the workers
@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
def test_first_layer_gates_from_the_distinct_tokens(monkeypatch, torch_threads, threads, weights):
    """A batch that repeats its tokens: the first layer's input matmul runs on the table,
    and every layer gets the numbers of the tokens written out row by row."""
    torch_threads(threads)
    monkeypatch.setattr(tuning, "INT8_MIN_ELEMENTS", 0)
    model = random_bilm()
    p = model.cfg.projection_dim
    g = torch.Generator().manual_seed(3)
    table = torch.cat([torch.zeros(1, p), torch.randn(4, p, generator=g)])  # row 0: padding
    lengths = torch.tensor([6, 9, 2, 9, 5])
    index = torch.randint(1, 5, (5, 9), generator=g)
    index[~length_mask(lengths, 9)] = 0
    tokens = table[index]
    seen = spy_gathers(monkeypatch)
    with torch.inference_mode():
        got = CpuBiLM(model, weights=weights).contextualize(
            tokens, lengths, distinct=(table, index)
        )
    assert seen == [(5, int(lengths.sum()))] * 2  # layer 1, both directions
    want = fast(model, tokens, lengths, weights)
    assert len(seen) == 2  # without the table: rows as before
    assert (got - want).abs().max() <= 1e-6
    assert (got - plain(model, tokens, lengths)).abs().max() <= (TOL if weights == "fp32" else 1)
    for r, n in enumerate(lengths.tolist()):
        assert (got[:, r, n:] == 0).all()
    # a table nearly as long as the rows saves nothing: the rows' own matmul runs
    many = torch.cat([table, torch.randn(40, p, generator=g)])
    with torch.inference_mode():
        CpuBiLM(model, weights=weights).contextualize(tokens, lengths, distinct=(many, index))
    assert len(seen) == 2


def test_the_embedder_passes_its_distinct_tokens(monkeypatch, tmp_path):
    emb = Embedder.load(tiny_artifact(tmp_path / "m"), threads=1, token_cache_size=0)
    seen = spy_gathers(monkeypatch)
    sentences = [["the", "cat", "the", "dog"], ["the", "the", "cat"], ["dog", "the"]]
    together = emb.embed_tokens(sentences)
    # <S>, </S>, the, cat, dog and the padding row, for 15 real rows
    assert seen and all(s == (6, 15) for s in seen)
    for sent, got in zip(sentences, together, strict=True):
        (alone,) = emb.embed_tokens([sent])
        assert np.abs(alone - got).max() <= TOL


def rounded_model(model: BiLM, mode: str) -> BiLM:
    """The model with its LSTM matrices rounded as ``mode`` rounds them, in fp32."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for layer in [*out.forward_layers, *out.backward_layers]:
            for lin in (layer.w_ih, layer.w_hh, layer.w_proj):
                lin.weight.copy_(round_weight(lin.weight, mode)[0])
    return out


@pytest.mark.parametrize("b", [1, 5])  # the compact single-sentence loop; batched matmuls
@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_rounded_weights_error_is_the_rounding_alone(monkeypatch, mode, b):
    """int8 / bf16: the compact loop really runs (one sentence), the vectors are those of
    exact fp32 on the rounded weights (so the error is the rounding, nothing else), and
    they differ from fp32's by a bounded, non-zero amount."""
    calls = []
    real = bilstm.lstmp_row  # one loop; the compact weights' dtype says the format
    dtype = np.int8 if mode == "int8" else np.uint16
    monkeypatch.setattr(
        bilstm, "lstmp_row", lambda *a: calls.append(a[1].dtype == dtype) or real(*a)
    )
    model = random_bilm()
    tokens, lengths = batch(b, 10, model.cfg.projection_dim)
    if b == 1:
        lengths[:] = 10
    ref = fast(model, tokens, lengths)
    calls.clear()  # the fp32 reference runs the same loop on its fp32 weights
    got = fast(model, tokens, lengths, mode)
    assert (len(calls) > 0) == (b == 1) and all(calls)
    exact_on_rounded = fast(rounded_model(model, mode), tokens, lengths)
    assert (got - exact_on_rounded).abs().max() <= TOL
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert 1e-5 < rel < (2e-2 if mode == "int8" else 5e-3), rel
    assert torch.equal(got[0], ref[0])  # layer 0 (token vectors) is untouched


def test_compact_forms_hold_the_rounded_numbers():
    """The blocked int8 / bf16 ``W^T`` widened back equals the rounded fp32 ``W``."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 70, generator=g)  # 300 outputs: a partial last block
    for mode in ("int8", "bf16"):
        rounded, compact, scale = round_weight(w, mode)
        n_b, k, jb = compact.shape
        wt = compact.transpose(1, 0, 2).reshape(k, n_b * jb)[:, :300]
        if mode == "bf16":
            wt = (wt.astype(np.uint32) << 16).view(np.float32)
        back = torch.from_numpy(wt.astype(np.float32) * scale[None, :]).t()
        assert torch.equal(back, rounded), mode
        rel = float((rounded - w).abs().max() / w.abs().max())
        assert 0 < rel < (1 / 127 if mode == "int8" else 1 / 128), (mode, rel)


def test_int8_linear_error_is_the_weights_alone(monkeypatch):
    """The input rides at ~13 bits: the result is that of the int8-rounded weights."""
    monkeypatch.setattr(tuning, "INT8_MIN_ELEMENTS", 0)
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(256, 64, generator=g), torch.randn(256, generator=g)
    x = torch.randn(5, 64, generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [0.2], [5.0]])
    step = w.abs().amax(1, keepdim=True) / 127
    rounded = F.linear(x, (w / step).round() * step, b)
    got = PackedLinear(w, b, int8=True)(x)
    exact = F.linear(x, w, b)
    assert ((got - rounded).norm(dim=1) / (exact - b).norm(dim=1)).max() < 2e-3
    assert (got - exact).abs().max() > 1e-4  # the weights really are int8
    # rows do not see each other
    assert (PackedLinear(w, b, int8=True)(x[2:3]) - got[2:3]).abs().max() <= TOL


def test_weight_updates_and_loads_invalidate_the_packed_weights():
    model = random_bilm()
    kernel = CpuBiLM(model)  # one kernel, kept across the changes
    tokens, lengths = batch(3, 6, model.cfg.projection_dim)
    ids = torch.randint(1, 262, (4, model.cfg.max_chars_per_token))
    before = kernel.contextualize(tokens, lengths)
    with torch.no_grad():  # an optimizer step: in place
        model.backward_layers[1].w_hh.weight.mul_(0.5)
        model.token_encoder.highways[0].weight.mul_(0.5)
        model.token_encoder.convs[0].weight.mul_(2)
    after = kernel.contextualize(tokens, lengths)
    assert (after - before).abs().max() > 1e-3
    assert (after - plain(model, tokens, lengths)).abs().max() <= TOL
    assert (kernel.encode(ids) - ref_char_cnn(model, ids)).abs().max() <= TOL
    model.load_state_dict(random_bilm(seed=5).state_dict())  # a hot swap into the same module
    assert (
        kernel.contextualize(tokens, lengths) - plain(model, tokens, lengths)
    ).abs().max() <= TOL
    assert (kernel.encode(ids) - ref_char_cnn(model, ids)).abs().max() <= TOL
    copied = copy.deepcopy(model)  # a copy's own kernel agrees
    assert (fast(copied, tokens, lengths) - kernel.contextualize(tokens, lengths)).abs().max() == 0


def test_training_still_takes_the_autograd_path():
    model = random_bilm().train()
    model.dropout.p = 0.0
    tokens, lengths = batch(3, 5, model.cfg.projection_dim)
    out = model.contextualize(tokens, lengths)
    assert out.requires_grad
    out.sum().backward()
    assert model.forward_layers[0].w_hh.weight.grad is not None
    with pytest.raises(ConfigError) as e:  # the CPU kernel is fp32 (or int8 weights) only
        CpuBiLM(copy.deepcopy(model).double())
    assert e.value.field == "device"


def test_character_cnn_packed_path_equals_the_reference():
    model = random_bilm()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 262, (11, model.cfg.max_chars_per_token), generator=g)
    with torch.inference_mode():
        got = CpuBiLM(model).encode(ids)
    assert (got - ref_char_cnn(model, ids)).abs().max() <= TOL


@pytest.mark.parametrize("n,k", [(64, 16), (16, 64), (1024, 1024)])  # wide, tall, oneDNN-sized
@pytest.mark.parametrize("m", [1, 5])
def test_packed_linear_equals_f_linear(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x, add = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    scale = 1e-5 * (k**0.5)  # fp32 summation-order differences grow with K
    for bias in (None, b):
        given_wt = PackedLinear(w, bias)
        given_wt.use_transposed(w.t().contiguous())
        # lazily packed; packed now without the fp32 copy, with and without W^T
        for lin in (PackedLinear(w, bias), PackedLinear(w, bias).pack_now(), given_wt.pack_now()):
            want = F.linear(x, w, bias)
            assert (lin(x) - want).abs().max() <= scale
            assert (lin(x, add=add) - (want + add)).abs().max() <= scale


def test_embedder_weights_option(tmp_path):
    art = tiny_artifact(tmp_path / "m")
    fp32 = Embedder.load(art, threads=1)
    assert fp32.certificate is None and fp32.speed_path == "cpu-native fp32"  # exact
    ref = fp32.embed(list(SENTENCES))
    scale = max(float(np.abs(r.layers).max()) for r in ref)
    prefixes = {fp32.cache_key_prefix}
    for mode in ("int8", "bf16"):
        emb = Embedder.load(art, threads=1, weights=mode)
        assert emb.cache_key_prefix == fp32.cache_key_prefix + f":w-{mode}"
        prefixes.add(emb.cache_key_prefix)
        assert emb.speed_path == f"cpu-native {mode}"
        cert = emb.certificate
        assert cert["weights"] == mode and cert["sentences"] >= 100  # the generated set
        assert cert["heldout"] is None  # the tiny artifact ships no held-out text
        assert 1e-6 < cert["max_rel_diff"] < 1.0, cert  # a random tiny model: a loose bound
        # the certificate bounds what a caller gets on its sentences, alone or together
        got = [emb.embed([s])[0] for s in SENTENCES[:4]] + emb.embed(list(SENTENCES[4:]))
        worst = max(float(np.abs(g.layers - r.layers).max()) for g, r in zip(got, ref, strict=True))
        assert 0 < worst <= cert["max_rel_diff"] * scale * (1 + 1e-3) + 1e-7
    prefixes.add(Embedder.load(art, threads=1, precision="bf16").cache_key_prefix)
    assert len(prefixes) == 4  # fp32, int8, bf16 weights, bf16 autocast: never shared
    for kwargs in ({"weights": "int4"}, {"weights": "int8", "precision": "bf16"}):
        with pytest.raises(ConfigError) as e:
            Embedder.load(art, threads=1, **kwargs)
        assert e.value.field == "weights"
