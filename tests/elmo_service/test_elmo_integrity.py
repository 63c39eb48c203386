"""``Elmo`` after its first forward: weights written any way are followed, the module
pickles and compiles, empty batches, float64, and the opt-in per-sentence layer cache.

Every comparison is against a fresh module on the same weights (or the float64
textbook reference), within the project's bound: 1e-5 x max(1, largest |value|).
"""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from torch.func import functional_call

from elmo_service import Elmo, batch_to_ids
from elmo_service.bilm.char_ids import sentence_ids
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.layer_cache import LayerCache, WeightsWatch, sentence_key
from elmo_service.errors import ConfigError
from tests.support import reference
from tests.support.core_fixtures import tiny_model

SENTENCES = [
    ["The", "bank", "of", "the", "river", "flooded", "again", "."],
    ["naïve", "café", "日本語"],
    ["a"],
    ["The", "river", "."],
]


def _model():
    return tiny_model(filters=((1, 4), (2, 8), (3, 8)), cell_clip=0.8, proj_clip=0.5, n_highway=1)


def _out(elmo: Elmo, sentences=SENTENCES) -> torch.Tensor:
    with torch.no_grad():
        return elmo(batch_to_ids(sentences))["elmo_representations"][0]


def _fresh(bilm) -> Elmo:
    """A new module on a copy of ``bilm``'s current weights: nothing cached from before."""
    return Elmo(None, None, 1, bilm=copy.deepcopy(bilm), dropout=0.0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    bound = 1e-5 * max(1.0, float(b.abs().max()))
    return float((a.double() - b.double()).abs().max()) <= bound


# --------------------------------------------------------------------------- stale weights
def _data_mul(elmo, p, q):
    p.data.mul_(0.5)


def _data_copy(elmo, p, q):
    p.data.copy_(q)


def _data_one_element(elmo, p, q):
    p.data.view(-1)[7] += 1.0  # one element, through .data: no version bump


def _data_swap_rows(elmo, p, q):
    p.data[[0, 1]] = p.data[[1, 0]].clone()  # same values, other places


def _copy_no_grad(elmo, p, q):
    with torch.no_grad():
        p.copy_(q)


def _load_state_dict(elmo, p, q):
    other = tiny_model(seed=3, filters=((1, 4), (2, 8), (3, 8)), n_highway=1)
    elmo._elmo_lstm.load_state_dict(other.state_dict())


def _optimizer_step(elmo, p, q):
    bilm = elmo._elmo_lstm
    bilm.requires_grad_(True)
    opt = torch.optim.SGD(bilm.parameters(), lr=0.5)
    elmo(batch_to_ids(SENTENCES))["elmo_representations"][0].sum().backward()
    opt.step()
    bilm.requires_grad_(False)


def _to_double(elmo, p, q):
    elmo.to(torch.float64)


WRITES = [
    _data_mul,
    _data_copy,
    _data_one_element,
    _data_swap_rows,
    _copy_no_grad,
    _load_state_dict,
    _optimizer_step,
    _to_double,
]


@pytest.mark.parametrize("write", WRITES, ids=[w.__name__.strip("_") for w in WRITES])
@pytest.mark.parametrize(
    "weight", ["token_encoder.highways.0.weight", "forward_layers.1.w_hh.weight"]
)
def test_every_way_of_writing_a_weight_is_seen_by_the_next_forward(write, weight):
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0)
    before = _out(elmo)  # builds the kernel's packed copies
    p = elmo._elmo_lstm.get_parameter(weight)
    q = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3
    write(elmo, p, q)
    after = _out(elmo)
    want = _out(_fresh(elmo._elmo_lstm))
    assert after.dtype == want.dtype
    assert _close(after, want), float((after - want).abs().max())
    if write is not _to_double:  # the write mattered
        assert float((after.double() - before.double()).abs().max()) > 1e-4


def test_unchanged_weights_keep_the_kernel():
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0)
    _out(elmo)
    kernel = elmo._kernel
    _out(elmo)
    assert elmo._kernel is kernel


def test_the_watch_sees_writes_that_keep_version_and_pointer():
    t = torch.randn(40, 300)
    watch = WeightsWatch()
    assert watch.changed([t])
    assert not watch.changed([t])
    t.data[3, 299] += 0.25  # the tail past the last full chunk of 256
    assert watch.changed([t])
    t.data[39, 5] -= 0.25
    assert watch.changed([t])
    assert not watch.changed([t])


# --------------------------------------------------------------------------- pickling, compile
def test_pickle_and_torch_save_after_a_forward():
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0, cache_bytes=2**20)
    want = _out(elmo)
    assert elmo._kernel is not None
    again = pickle.loads(pickle.dumps(elmo))
    assert torch.equal(_out(again), want)
    buf = io.BytesIO()
    torch.save(elmo, buf)  # a user's own file; this project's models are safetensors
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(_out(loaded), want)
    assert torch.equal(_out(copy.deepcopy(elmo)), want)
    assert elmo._kernel is not None  # the original keeps its caches


@pytest.mark.slow  # inductor compiles the mixes: ~45 s on 2 loaded cores
def test_torch_compile_of_the_frozen_path_runs_and_agrees():
    elmo = Elmo(None, None, 2, bilm=_model(), dropout=0.0)
    want = elmo(batch_to_ids(SENTENCES))
    got = torch.compile(elmo)(batch_to_ids(SENTENCES))
    for a, b in zip(got["elmo_representations"], want["elmo_representations"], strict=True):
        assert _close(a.detach(), b.detach())
    assert torch.equal(got["mask"], want["mask"])


# --------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("keep", [False, True])
def test_a_batch_of_empty_sentences_gives_empty_outputs(keep):
    elmo = Elmo(None, None, 2, bilm=_model(), dropout=0.0, keep_sentence_boundaries=keep)
    d = elmo.get_output_dim()
    out = elmo(batch_to_ids([[], []]))
    t = 2 if keep else 0  # the markers alone
    for rep in out["elmo_representations"]:
        assert rep.shape == (2, t, d) and bool(torch.isfinite(rep).all())
    assert out["mask"].shape == (2, t) and out["mask"].dtype == torch.bool
    assert bool(out["mask"].all()) if keep else True
    # extra leading dims too, and an empty sentence beside a real one
    assert elmo(batch_to_ids([[]]).unsqueeze(0))["mask"].shape == (1, 1, t)
    cached = Elmo(None, None, 1, bilm=_model(), vocab_to_cache=["@@PADDING@@", "a"])
    words = torch.zeros(2, 0, dtype=torch.long)
    assert cached(batch_to_ids([[], []]), words)["elmo_representations"][0].shape == (2, 0, d)
    mixed = elmo(batch_to_ids([["a", "b"], []]))
    assert mixed["mask"].tolist() == ([[1, 1, 1, 1], [1, 1, 0, 0]] if keep else [[1, 1], [0, 0]])


# --------------------------------------------------------------------------- float64
def test_double_runs_the_lstm_in_float64_and_gradcheck_passes():
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0, requires_grad=True).double()
    ids = batch_to_ids([["ab", "c"], ["d"]])
    for name in (
        "_elmo_lstm.forward_layers.0.w_hh.weight",
        "_elmo_lstm.backward_layers.1.w_ih.bias",
    ):
        w0 = elmo.get_parameter(name).detach().clone().requires_grad_(True)

        def f(w, name=name):
            return functional_call(elmo, {name: w}, (ids,))["elmo_representations"][0]

        assert torch.autograd.gradcheck(f, (w0,), eps=1e-6, atol=1e-7)


def test_frozen_double_equals_the_float64_reference():
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0).double()
    got = _out(elmo)
    assert got.dtype == torch.float64
    bilm = elmo._elmo_lstm
    for b, sentence in enumerate(SENTENCES):
        ids = torch.from_numpy(sentence_ids(sentence, bilm.cfg.max_chars_per_token))
        with torch.no_grad():
            layers = reference.bilstm(
                bilm, reference.char_cnn(bilm, ids, torch.float64), torch.float64
            )
        want = layers.mean(0)[1:-1]  # equal mix weights, gamma 1
        assert float((got[b, : len(sentence)] - want).abs().max()) <= 1e-12


# --------------------------------------------------------------------------- the layer cache
def _count_bilm_rows(monkeypatch) -> list[int]:
    rows: list[int] = []
    real = CpuBiLM.contextualize

    def counted(self, tokens, lengths, distinct=None):
        rows.append(tokens.shape[0])
        return real(self, tokens, lengths, distinct)

    monkeypatch.setattr(CpuBiLM, "contextualize", counted)
    return rows


def test_the_cache_runs_each_sentence_once_with_the_same_outputs(monkeypatch):
    model = _model()
    plain = Elmo(None, None, 1, bilm=model, dropout=0.0)
    cached = Elmo(None, None, 1, bilm=model, dropout=0.0, cache_bytes=2**20)
    rows = _count_bilm_rows(monkeypatch)
    a = _out(cached)
    assert rows == [len(SENTENCES)]
    assert torch.equal(a, _out(plain))
    # again, in other batches, a sentence twice: no biLM run at all
    rows.clear()
    batches = [[SENTENCES[2], SENTENCES[0], SENTENCES[2]], [SENTENCES[3]]]
    for batch in batches:
        got = _out(cached, batch)
        assert _close(got, _out(plain, batch))
    assert rows == [len(b) for b in batches]  # the plain module's runs only
    # a batch with one new sentence runs that one alone, once
    rows.clear()
    _out(cached, [SENTENCES[1], ["new", "words"], ["new", "words"]])
    assert rows == [1]
    stats = cached.cache_stats
    assert stats["entries"] == len(SENTENCES) + 1 and stats["hits"] >= 5


def test_the_cache_is_bounded_by_bytes_least_recent_first():
    cache = LayerCache(max_bytes=3 * 400)
    for k in range(5):
        cache.put(bytes([k]), torch.zeros(100))  # 400 bytes each
    assert len(cache) == 3 and cache.bytes == 1200
    assert cache.get(bytes([0])) is None and cache.get(bytes([2])) is not None
    cache.put(bytes([9]), torch.zeros(100))  # 3 was the least recently used
    assert cache.get(bytes([3])) is None and cache.get(bytes([2])) is not None
    cache.put(b"big", torch.zeros(1000))  # larger than the whole budget: not kept
    assert cache.get(b"big") is None and cache.bytes <= 1200
    # the key is the sentence's ids, shape included
    ids = np.arange(100).reshape(2, 50)
    assert sentence_key(ids) != sentence_key(ids.reshape(1, 100))
    assert sentence_key(ids) == sentence_key(ids.copy())


def test_a_weight_change_empties_the_cache():
    elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.0, cache_bytes=2**20)
    _out(elmo)
    elmo._elmo_lstm.token_encoder.projection.weight.data.mul_(2.0)
    got = _out(elmo)
    assert _close(got, _out(_fresh(elmo._elmo_lstm)))
    assert elmo.cache_stats["hits"] == 0


def test_the_cache_is_refused_where_layers_are_not_the_sentence_s_alone():
    for kwargs in ({"requires_grad": True}, {"stateful": True}):
        with pytest.raises(ConfigError, match="cache_bytes needs a frozen biLM") as e:
            Elmo(None, None, 1, bilm=_model(), cache_bytes=2**20, **kwargs)
        assert e.value.field == "cache_bytes"
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError) as e:
            Elmo(None, None, 1, bilm=_model(), cache_bytes=bad)
        assert e.value.field == "cache_bytes"


def test_a_tiny_finetune_scores_the_same_with_and_without_the_cache():
    """A tagger over a frozen Elmo, 3 epochs of shuffled batches, same seeds: the same
    losses and accuracy, and from epoch 2 on the biLM does not run at all."""
    rng = np.random.default_rng(0)
    words = ["the", "a", "river", "bank", "ran", "fast", "slow", "dog", "cat", "."]
    sentences = [[words[i] for i in rng.integers(0, 10, rng.integers(1, 9))] for _ in range(40)]
    tags = [[int(w in ("the", "a")) + 2 * int(w == ".") for w in s] for s in sentences]

    def run(cache_bytes: int) -> tuple[list[float], float, dict | None]:
        torch.manual_seed(0)
        order = np.random.default_rng(1)
        elmo = Elmo(None, None, 1, bilm=_model(), dropout=0.3, cache_bytes=cache_bytes)
        head = torch.nn.Linear(elmo.get_output_dim(), 3)
        opt = torch.optim.Adam([*elmo.parameters(), *head.parameters()], lr=1e-2)
        losses = []
        for _ in range(3):
            elmo.train()
            perm = order.permutation(40)
            for start in range(0, 40, 8):
                idx = perm[start : start + 8]
                batch = [sentences[i] for i in idx]
                out = elmo(batch_to_ids(batch))
                mask = out["mask"]
                gold = torch.zeros(mask.shape, dtype=torch.long)
                for j, i in enumerate(idx):
                    gold[j, : len(tags[i])] = torch.tensor(tags[i])
                logits = head(out["elmo_representations"][0])
                loss = torch.nn.functional.cross_entropy(logits[mask], gold[mask])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        elmo.eval()
        with torch.no_grad():
            out = elmo(batch_to_ids(sentences))
            pred = head(out["elmo_representations"][0]).argmax(-1)
        right = sum(int((pred[i, : len(t)] == torch.tensor(t)).sum()) for i, t in enumerate(tags))
        return losses, right / sum(map(len, tags)), elmo.cache_stats

    plain_losses, plain_acc, _ = run(0)
    cached_losses, cached_acc, stats = run(2**22)
    assert cached_losses == plain_losses
    assert cached_acc == plain_acc
    assert stats["hits"] > stats["misses"] > 0


def test_the_cache_on_disk_serves_another_module_on_the_same_weights(tmp_path, monkeypatch):
    model = _model()
    first = Elmo(None, None, 1, bilm=model, dropout=0.0, cache_bytes=2**20, cache_dir=tmp_path)
    want = _out(first)
    shards = list(tmp_path.glob("*/*.safetensors"))
    assert len(shards) == 1  # one batch, one shard, in the weights' folder
    rows = _count_bilm_rows(monkeypatch)
    # another module (another process, as far as the cache knows) on a copy of the weights
    second = Elmo(
        None, None, 1, bilm=copy.deepcopy(model), dropout=0.0, cache_bytes=2**20, cache_dir=tmp_path
    )
    assert torch.equal(_out(second), want)
    assert rows == [] and second.cache_stats["disk_hits"] == len(SENTENCES)
    # other weights: another folder, nothing read back
    second._elmo_lstm.token_encoder.projection.weight.data.mul_(2.0)
    got = _out(second)
    assert rows == [len(SENTENCES)] and _close(got, _out(_fresh(second._elmo_lstm)))
    assert len({p.parent for p in tmp_path.glob("*/*.safetensors")}) == 2
    # a damaged shard is skipped: its sentences are computed again
    shards[0].write_bytes(b"not a shard")
    rows.clear()
    third = Elmo(None, None, 1, bilm=_model(), dropout=0.0, cache_bytes=2**20, cache_dir=tmp_path)
    assert _close(_out(third), want) and rows == [len(SENTENCES)]
    with pytest.raises(ConfigError) as e:
        Elmo(None, None, 1, bilm=_model(), cache_dir=tmp_path)
    assert e.value.field == "cache_dir"
