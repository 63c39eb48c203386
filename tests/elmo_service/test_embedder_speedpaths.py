"""The model's inference paths and the embedder compute the plain ELMo function.

``model.py`` runs the character CNN by table lookup at inference and the LSTM
on length-sorted rows that shrink as sentences end; the CPU kernel looks the
filters up in native code; the embedder caches token vectors and may
``torch.compile`` the biLSTM. Each is checked against the one reference
(``tests/support/reference.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from elmo_service.artifact import Artifact
from elmo_service.bilm.char_ids import batch_ids, sentence_ids
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.model import N_CHAR_IDS, BiLM
from elmo_service.bilm.runner import Runner
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import WordTokenizer
from tests.support.configs import small_test_config
from tests.support.reference import char_cnn as ref_char_cnn
from tests.support.reference import reference_bilm as ref_bilm

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
def test_native_filter_lookup_is_the_torch_lookup_to_the_bit(monkeypatch, torch_threads, threads):
    import elmo_service.bilm.kernels.native_filters as native_filters
    import elmo_service.bilm.kernels.tuning as tuning

    torch_threads(threads)
    model = make_model(max_chars_per_token=12)
    w = model.cfg.max_chars_per_token
    rng = np.random.default_rng(1)
    words = ["".join(rng.choice(list("abcdefgh"), size=n)) for n in rng.integers(0, 14, 70)]
    ids = torch.from_numpy(np.stack([sentence_ids([x], w)[1] for x in words]))
    ids = torch.cat([ids, torch.from_numpy(rng.integers(0, N_CHAR_IDS, size=(5, w)))])
    enc, kernel = model.token_encoder, CpuBiLM(model)
    monkeypatch.setattr(tuning, "NATIVE_SPLIT_MIN_TOKENS", 32)
    calls = []
    real = native_filters.char_filters
    monkeypatch.setattr(
        native_filters, "char_filters", lambda *a: calls.append(len(a[0])) or real(*a)
    )
    with torch.inference_mode():
        native = kernel._filters(ids)
        assert sorted(calls) == ([37, 38] if threads == 2 else [75])
        assert torch.equal(kernel._filters(ids.to(torch.int32)), native)
        assert torch.equal(kernel._filters(ids[:1]), native[:1])  # alone
        torch_loop = enc._filters_lookup(ids)
    assert len(calls) == (5 if threads == 2 else 3)  # the torch loop added none
    assert torch.equal(native, torch_loop)


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
    model = make_model()
    emb = make_embedder(model, token_cache_size=cache)
    asked: list[int] = []  # rows of each CNN call
    real = Runner._encode_ids
    monkeypatch.setattr(
        Runner, "_encode_ids", lambda self, ids: asked.append(len(ids)) or real(self, ids)
    )
    markers = 2  # the markers' call has two rows; the sentences' tokens come in other calls
    first = emb.embed_tokens(SENTENCES)
    assert asked.count(markers) == 1
    asked.clear()
    emb.embed_tokens([["new", "words", "here"], []])  # an empty sentence: markers alone
    assert asked == [3]  # the three new words, no markers
    asked.clear()
    for got, sent in zip(first, SENTENCES, strict=True):
        assert np.abs(got - ref_bilm(model, sent)[:, 1:-1].detach().numpy()).max(initial=0) <= 1e-5
    with torch.no_grad():
        model.token_encoder.char_embed.weight.mul_(1.5)  # a new weight version
    emb.runner.resize_cache(cache)
    again = emb.embed_tokens(SENTENCES[:1])[0]
    assert asked.count(markers) == 1
    assert (
        np.abs(again - ref_bilm(model, SENTENCES[0])[:, 1:-1].detach().numpy()).max(initial=0)
        <= 1e-5
    )


@pytest.mark.parametrize("cache", [0, 1000])
def test_a_token_spelled_like_a_marker_key_gets_its_own_vector(cache):
    """#28 item 12: the markers used to be keyed "\x00<S>" / "\x00</S>" beside the token
    texts, so a pre-tokenized word with those characters got the marker's vector."""
    model = make_model()
    emb = make_embedder(model, token_cache_size=cache)
    sent = ["\x00<S>", "bank", "\x00</S>", "<S>", "</S>"]
    for _ in range(2):  # the second time from the token cache, when there is one
        got = emb.embed_tokens([sent, ["river"]])[0]
        want = ref_bilm(model, sent)[:, 1:-1].numpy()
        assert np.abs(got - want).max() <= 1e-5
    markers = ref_bilm(model, [])[0]  # layer 0 of <S>, </S>
    for pos in (0, 2):
        assert np.abs(got[0, pos] - markers[0].numpy()).max() > 1e-3
        assert np.abs(got[0, pos] - markers[1].numpy()).max() > 1e-3


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
