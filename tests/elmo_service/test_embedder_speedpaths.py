"""The fast paths of the model and the embedder compute the plain ELMo function.

``model.py`` runs the character CNN by table lookup at inference, the LSTM
with sigmoid-based tanh on length-sorted rows that shrink as sentences end,
and the embedder caches token vectors and may ``torch.compile`` the biLSTM.
Each is checked here against a reference written plainly in this file (a
per-position convolution, a per-step LSTM with the input matmul inside the
loop, one sentence at a time, no sorting, no cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elmo_service.artifact import Artifact
from elmo_service.char_ids import batch_ids, sentence_ids
from elmo_service.config import BiLMConfig
from elmo_service.embedder import Embedder
from elmo_service.model import N_CHAR_IDS, BiLM
from elmo_service.tokenizers import WordTokenizer
from tests.support.configs import small_test_config

torch.set_num_threads(1)

SENTENCES = [
    ["The", "bank", "of", "the", "river", "."],
    ["Money"],
    [],
    ["a", "supercalifragilisticexpialidociously-long-token-that-gets-cut-at-48-bytes", "café"],
    ["the", "old", "stone", "bridge", "over", "the", "river", "bank", "every", "morning", "!"],
]


def make_model(seed: int = 0, **overrides) -> BiLM:
    """A small random biLM with weights large enough that every layer carries signal."""
    torch.manual_seed(seed)
    cfg = small_test_config(**{"filters": ((1, 4), (2, 8), (3, 8), (5, 6), (7, 5)), **overrides})
    model = BiLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        model.token_encoder.char_embed.weight[0] = 0  # padding row stays zero
    return model


def make_embedder(model: BiLM, **kwargs) -> Embedder:
    art = Artifact(
        path=Path("in-memory"),
        config=model.cfg,
        tokenizer=WordTokenizer(),
        model=model,
        version="t",
    )
    return Embedder(art, device="cpu", **kwargs)


# -- the plain reference --------------------------------------------------------
def ref_char_cnn(model: BiLM, ids: torch.Tensor) -> torch.Tensor:
    """``[N, W]`` -> ``[N, P]``: every window of every filter as its own dot product."""
    enc, cfg = model.token_encoder, model.cfg
    emb = enc.char_embed.weight[ids]  # [N, W, D]
    act = torch.tanh if cfg.activation == "tanh" else F.relu
    feats = []
    for (width, _), conv in zip(cfg.filters, enc.convs, strict=True):
        windows = [
            torch.einsum("nkd,fdk->nf", emb[:, p : p + width], conv.weight) + conv.bias
            for p in range(ids.shape[1] - width + 1)
        ]
        feats.append(act(torch.stack(windows, dim=1).max(dim=1).values))
    x = torch.cat(feats, dim=-1)
    for hw in enc.highways:
        transform, carry = F.linear(x, hw.weight, hw.bias).chunk(2, dim=-1)
        gate = torch.sigmoid(carry)
        x = gate * F.relu(transform) + (1 - gate) * x
    return F.linear(x, enc.projection.weight, enc.projection.bias)


def ref_lstm(layer, xs: torch.Tensor) -> torch.Tensor:
    """One direction over one sentence ``[T, in]``, one step at a time."""
    c_dim = layer.cell_dim
    h = torch.zeros(layer.proj_dim)
    c = torch.zeros(c_dim)
    outs = []
    for x in xs:
        gates = layer.w_ih.weight @ x + layer.w_ih.bias + layer.w_hh.weight @ h
        i, f, o, g = (gates[k * c_dim : (k + 1) * c_dim] for k in range(4))
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        if layer.cell_clip is not None:
            c = c.clamp(-layer.cell_clip, layer.cell_clip)
        h = layer.w_proj.weight @ (torch.sigmoid(o) * torch.tanh(c))
        if layer.proj_clip is not None:
            h = h.clamp(-layer.proj_clip, layer.proj_clip)
        outs.append(h)
    return torch.stack(outs) if outs else xs.new_zeros(0, layer.proj_dim)


def ref_bilm(model: BiLM, tokens: list[str]) -> torch.Tensor:
    """One sentence (markers included) -> ``[L+1, T+2, 2P]``."""
    e = ref_char_cnn(model, torch.from_numpy(sentence_ids(tokens, model.cfg.max_chars_per_token)))
    layers = [torch.cat([e, e], dim=-1)]
    fwd_in, bwd_in = e, e.flip(0)
    for i, (fwd, bwd) in enumerate(zip(model.forward_layers, model.backward_layers, strict=True)):
        f, r = ref_lstm(fwd, fwd_in), ref_lstm(bwd, bwd_in)
        if model.cfg.residual and i > 0:
            f, r = f + fwd_in, r + bwd_in
        fwd_in, bwd_in = f, r
        layers.append(torch.cat([f, r.flip(0)], dim=-1))
    return torch.stack(layers)


# -- model vs reference ---------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "activation": "tanh",
            "cell_clip": None,
            "proj_clip": None,
            "n_highway": 2,
            "residual": False,
        },
    ],
)
def test_model_matches_plain_reference_in_a_padded_unsorted_batch(overrides):
    model = make_model(**overrides)
    ids, lengths = batch_ids(SENTENCES, model.cfg.max_chars_per_token)
    with torch.inference_mode():
        out = model(torch.from_numpy(ids), torch.from_numpy(lengths))
        for b, sent in enumerate(SENTENCES):
            ref = ref_bilm(model, sent)
            n = len(sent) + 2
            assert (out[:, b, :n] - ref).abs().max() <= 1e-5
            assert not out[:, b, n:].any()  # padding is zero in every layer


def test_char_cnn_lookup_equals_conv_and_reference_on_odd_inputs():
    model = make_model(max_chars_per_token=12)  # widths up to 7 against short tokens
    w = model.cfg.max_chars_per_token
    rng = np.random.default_rng(0)
    rows = [sentence_ids(["x" * n], w)[1] for n in range(0, 12)]  # every length, cut at w - 2
    rows += [
        np.zeros(w, dtype=np.int64),
        np.full(w, 261, dtype=np.int64),
    ]  # "no token", all padding
    rows += list(rng.integers(0, N_CHAR_IDS, size=(6, w)))  # arbitrary ids, no padding tail
    ids = torch.from_numpy(np.stack(rows))
    enc = model.token_encoder
    with torch.no_grad():
        lookup = enc(ids)  # autograd off -> lookup tables
        ref = ref_char_cnn(model, ids)
    conv = enc(ids)  # autograd on -> Conv1d
    assert conv.requires_grad
    assert (lookup - ref).abs().max() <= 1e-5
    assert (conv.detach() - ref).abs().max() <= 1e-5
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lookup_bf16 = enc(ids).float()
    assert (lookup_bf16 - ref).abs().max() <= 0.05 * ref.abs().max()
    with torch.no_grad():
        assert enc(ids[:0]).shape == (0, model.cfg.projection_dim)


@pytest.mark.parametrize("threads", [1, 2])  # two: the tokens split over the workers
def test_native_filter_lookup_is_the_torch_lookup_to_the_bit(monkeypatch, threads):
    import elmo_service.model as model_mod

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = make_model(max_chars_per_token=12)
        w = model.cfg.max_chars_per_token
        rng = np.random.default_rng(1)
        words = ["".join(rng.choice(list("abcdefgh"), size=n)) for n in rng.integers(0, 14, 70)]
        ids = torch.from_numpy(np.stack([sentence_ids([x], w)[1] for x in words]))
        ids = torch.cat([ids, torch.from_numpy(rng.integers(0, N_CHAR_IDS, size=(5, w)))])
        enc = model.token_encoder
        monkeypatch.setattr(model_mod, "NATIVE_SPLIT_MIN_TOKENS", 32)
        calls = []
        real = model_mod.char_filters
        monkeypatch.setattr(
            model_mod, "char_filters", lambda *a: calls.append(len(a[0])) or real(*a)
        )
        with torch.inference_mode():
            native = enc._filters_lookup(ids)
            assert sorted(calls) == ([37, 38] if threads == 2 else [75])
            assert torch.equal(enc._filters_lookup(ids.to(torch.int32)), native)
            assert torch.equal(enc._filters_lookup(ids[:1]), native[:1])  # alone
            enc._tables_flat = None  # the torch loop
            torch_loop = enc._filters_lookup(ids)
        assert len(calls) == (5 if threads == 2 else 3)  # the torch loop added none
        assert torch.equal(native, torch_loop)
    finally:
        torch.set_num_threads(before)


def test_lookup_tables_follow_weight_changes():
    model = make_model()
    enc = model.token_encoder
    ids = torch.from_numpy(sentence_ids(["bank", "river"], model.cfg.max_chars_per_token))
    with torch.no_grad():
        before = enc(ids)
        other = make_model(seed=1)
        model.load_state_dict(other.state_dict())  # in-place copy_ into the parameters
        assert (enc(ids) - ref_char_cnn(other, ids)).abs().max() <= 1e-5
        enc.convs[0].weight.mul_(2)
        assert (enc(ids) - ref_char_cnn(model, ids)).abs().max() <= 1e-5
        assert (enc(ids) - before).abs().max() > 1e-3


# -- embedder: batching, cache, empty sentences ---------------------------------
def test_sentence_alone_in_a_batch_and_later_gives_the_same_vectors():
    model = make_model()
    emb = make_embedder(model, token_cache_size=1000, batch_tokens=40)  # several batches
    alone = [make_embedder(model, token_cache_size=0).embed_tokens([s])[0] for s in SENTENCES]
    together = emb.embed_tokens(SENTENCES)
    emb.embed_tokens([["unrelated", "words", "in", "between"]] * 3)
    later = emb.embed_tokens(list(reversed(SENTENCES)))[::-1]
    assert emb.cache_hits > 0
    for a, t, lt, sent in zip(alone, together, later, SENTENCES, strict=True):
        ref = ref_bilm(model, sent)[:, 1:-1].detach().numpy()
        assert np.abs(a - ref).max(initial=0) <= 1e-5
        assert np.abs(a - t).max(initial=0) <= 1e-5
        assert np.abs(a - lt).max(initial=0) <= 1e-5


@pytest.mark.parametrize("cache", [0, 1000])
def test_sentence_markers_go_through_the_cnn_once_per_weight_version(monkeypatch, cache):
    import elmo_service.embedder as embedder_mod

    model = make_model()
    emb = make_embedder(model, token_cache_size=cache)
    asked: list[list[str]] = []
    real = Embedder._encode_keys
    monkeypatch.setattr(Embedder, "_encode_keys", lambda self, k: asked.append(k) or real(self, k))
    markers = [embedder_mod._BOS, embedder_mod._EOS]
    first = emb.embed_tokens(SENTENCES)
    assert asked.count(markers) == 1 and sum(k.count(markers[0]) for k in asked) == 1
    emb.embed_tokens([["new", "words"], []])  # an empty sentence: markers alone
    assert asked.count(markers) == 1
    for got, sent in zip(first, SENTENCES, strict=True):
        assert np.abs(got - ref_bilm(model, sent)[:, 1:-1].detach().numpy()).max(initial=0) <= 1e-5
    with torch.no_grad():
        model.token_encoder.char_embed.weight.mul_(1.5)  # a new weight version
    emb._cache = None if cache == 0 else type(emb._cache)(cache)
    again = emb.embed_tokens(SENTENCES[:1])[0]
    assert asked.count(markers) == 2
    assert (
        np.abs(again - ref_bilm(model, SENTENCES[0])[:, 1:-1].detach().numpy()).max(initial=0)
        <= 1e-5
    )


def test_token_cache_does_not_change_vectors():
    model = make_model()
    sents = [s for _ in range(3) for s in SENTENCES]  # repeats: later ones hit the cache
    cached = make_embedder(model, token_cache_size=1000).embed_tokens(sents)
    uncached = make_embedder(model, token_cache_size=0).embed_tokens(sents)
    for a, b in zip(cached, uncached, strict=True):
        assert np.abs(a - b).max(initial=0) <= 1e-6


def test_empty_sentence_gives_zero_tokens():
    model = make_model()
    cfg: BiLMConfig = model.cfg
    for emb in (make_embedder(model), make_embedder(model, token_cache_size=0)):
        out = emb.embed_tokens([[], ["word"], []])
        assert out[0].shape == (cfg.n_output_layers, 0, cfg.output_dim)
        assert out[2].shape == (cfg.n_output_layers, 0, cfg.output_dim)
        assert out[1].shape == (cfg.n_output_layers, 1, cfg.output_dim)
        assert emb.embed_tokens([]) == []


# -- torch.compile: one small smoke test ----------------------------------------
@pytest.mark.slow
def test_compiled_matches_eager_and_reuses_its_bucket():
    from torch._dynamo.utils import counters

    model = make_model()
    eager = make_embedder(model, token_cache_size=0)
    compiled = make_embedder(model, token_cache_size=0, compile=True)
    five = [["the", "cat", "sat"], ["a"], ["on", "the", "mat", "today"], ["x", "y"], ["hello"]]
    seven = [*five[::-1], ["more", "words"], ["z", "z"]]  # another batch size, same length bucket
    first = compiled.embed_tokens(five)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    second = compiled.embed_tokens(seven)
    third = compiled.embed_tokens(five[:1])
    assert counters["stats"]["unique_graphs"] == graphs  # same length bucket: no recompile
    expected = eager.embed_tokens(five) + eager.embed_tokens(seven) + eager.embed_tokens(five[:1])
    for got, want in zip(first + second + third, expected, strict=True):
        assert np.abs(got - want).max(initial=0) <= 1e-5
