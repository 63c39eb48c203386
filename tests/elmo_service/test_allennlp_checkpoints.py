"""Checkpoints written with AllenNLP's ``Elmo`` load into ``elmo_service.Elmo`` and back.

AllenNLP 2.10.1 itself (``tests/install_parity_deps.sh``) writes the state dicts; the
bilm-tf files both sides start from are built here (``tests/support/bilm_fixtures.py``),
and every weight is then moved away from the file's, so that a key loaded into the
wrong place, or a gate or sign left unmapped, shows in the outputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elmo_service import Elmo, batch_to_ids
from elmo_service.allennlp_names import to_allennlp
from tests.support.allennlp_shim import allennlp_fixture  # noqa: F401 (allennlp)
from tests.support.bilm_fixtures import write_bilm

SENTENCES = [["The", "bank", "of", "the", "river", "."], ["naïve", "café"], ["a"]]
TOL = 1e-5


@pytest.fixture(scope="module")
def bilm_files(tmp_path_factory):
    # 261 characters, as the published models: AllenNLP's table then has our 262 rows
    return write_bilm(tmp_path_factory.mktemp("bilm"), n_characters=261, n_highway=2, seed=7)


def _moved(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter moved off the file's values (a trained model's checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _reps(elmo, ids) -> list[torch.Tensor]:
    with torch.no_grad():
        return elmo(ids)["elmo_representations"]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        assert (x - y).abs().max() <= TOL * max(1.0, float(x.abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("cache_bytes", [0, 2**24])
def test_an_allennlp_state_dict_loads_strictly_with_the_same_outputs(
    allennlp, bilm_files, cache_bytes
):
    options, weights = map(str, bilm_files)
    theirs = _moved(allennlp.Elmo(options, weights, 2, dropout=0.0), seed=1).eval()
    ours = Elmo(options, weights, 2, dropout=0.0, cache_bytes=cache_bytes).eval()
    ids = batch_to_ids(SENTENCES)
    before = _reps(ours, ids)  # runs the serving kernel (and fills the layer cache)
    assert any(k.startswith("_elmo_lstm._elmo_lstm.forward_layer_0.") for k in theirs.state_dict())
    result = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    after = _reps(ours, ids)
    # the kernel's packed copies and the cached layers followed the loaded weights
    assert (after[0] - before[0]).abs().max() > 0.01
    _close(_reps(theirs, ids), after)
    # and back: AllenNLP's Elmo takes ours under its names, strict
    again = allennlp.Elmo(options, weights, 2, dropout=0.0).eval()
    again.load_state_dict(ours.allennlp_state_dict(), strict=True)
    _close(_reps(again, ids), after)


class Tagger(nn.Module):
    """A model that holds ELMo, as AllenNLP users' models do."""

    def __init__(self, elmo_cls, options: str, weights: str) -> None:
        super().__init__()
        self.embedder = elmo_cls(options, weights, 1, dropout=0.0, vocab_to_cache=["the", "a"])
        self.tag = nn.Linear(self.embedder.get_output_dim(), 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tag(self.embedder(ids)["elmo_representations"][0])


@pytest.mark.slow
def test_a_model_holding_allennlps_elmo_loads_its_whole_checkpoint_after_the_swap(
    allennlp, bilm_files, tmp_path
):
    options, weights = map(str, bilm_files)
    theirs = _moved(Tagger(allennlp.Elmo, options, weights), seed=2).eval()
    path = tmp_path / "tagger.pt"
    torch.save(theirs.state_dict(), path)
    assert "embedder._elmo_lstm._word_embedding.weight" in theirs.state_dict()

    ours = Tagger(Elmo, options, weights).eval()  # the import swapped
    ours.load_state_dict(torch.load(path, weights_only=True), strict=True)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        a, b = theirs(ids), ours(ids)
    assert (a - b).abs().max() <= TOL * max(1.0, float(a.abs().max()))
    # the cached vocabulary moved with the checkpoint (it is a parameter on both sides)
    assert torch.equal(
        ours.embedder._word_embedding.weight,
        theirs.embedder._elmo_lstm._word_embedding.weight,
    )

    # ours back into AllenNLP's, the whole model at once
    back = Tagger(allennlp.Elmo, options, weights).eval()
    back.load_state_dict(to_allennlp(ours.state_dict()), strict=True)
    with torch.no_grad():
        c = back(ids)
    assert (a - c).abs().max() <= TOL * max(1.0, float(a.abs().max()))


def test_our_own_state_dicts_keep_loading(bilm_files, tmp_path):
    options, weights = bilm_files
    ours = _moved(Elmo(options, weights, 2, dropout=0.0), seed=3).eval()
    sd = ours.state_dict()
    # the names every earlier version wrote
    assert "_elmo_lstm.token_encoder.char_embed.weight" in sd
    assert "scalar_mix_0.scalars" in sd and sd["scalar_mix_0.gamma"].shape == ()
    torch.save(sd, tmp_path / "ours.pt")
    fresh = Elmo(options, weights, 2, dropout=0.0).eval()
    ids = batch_to_ids(SENTENCES)
    _reps(fresh, ids)
    fresh.load_state_dict(torch.load(tmp_path / "ours.pt", weights_only=True), strict=True)
    _close(_reps(ours, ids), _reps(fresh, ids))


def test_strict_loading_still_names_what_is_missing(bilm_files):
    options, weights = bilm_files
    ours = Elmo(options, weights, 1)
    sd = to_allennlp(ours.state_dict())
    del sd["_elmo_lstm._elmo_lstm.backward_layer_1.state_projection.weight"]
    sd["_elmo_lstm._elmo_lstm.forward_layer_9.state_projection.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as e:
        Elmo(options, weights, 1).load_state_dict(sd, strict=True)
    assert "backward_layers.1.w_proj.weight" in str(e.value)
    assert "forward_layers.9.w_proj.weight" in str(e.value)


def test_the_carried_state_resets_where_allennlp_reaches_it(bilm_files):
    options, weights = bilm_files
    elmo = Elmo(options, weights, 1, dropout=0.0, stateful=True).eval()
    ids = batch_to_ids(SENTENCES)
    first = _reps(elmo, ids)[0]
    assert (first - _reps(elmo, ids)[0]).abs().max() > 0  # carried
    elmo._elmo_lstm._elmo_lstm.reset_states()
    assert torch.equal(first, _reps(elmo, ids)[0])


# --------------------------------------------------------------------------- AllenNLP's tests
# The checks of AllenNLP 2.10.1's tests/modules/elmo_test.py, with the import swapped. Its
# fixture files (a biLM and TensorFlow's outputs for it) are not here: the biLM is
# bilm_files, and where it compared with TensorFlow's outputs this compares with AllenNLP's
# own modules run on the same files.
PAIR = [["The", "sentence", "."], ["ELMo", "helps", "disambiguate", "ELMo", "from", "Elmo", "."]]
WORDS = [["This", "is", "a", "sentence"], ["Here", "'s", "one"], ["Another", "one"]]


def _word_ids(batch: list[list[str]], vocab: list[str]) -> torch.Tensor:
    """AllenNLP's SingleIdTokenIndexer over ``vocab`` (0 padding, 1 unknown, words from 2)."""
    index = {w: i + 2 for i, w in enumerate(vocab)}
    out = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
    for b, s in enumerate(batch):
        out[b, : len(s)] = torch.tensor([index.get(w, 1) for w in s])
    return out


def _cache_vocab(batch: list[list[str]]) -> list[str]:
    """What AllenNLP's tests cache: its vocabulary's tokens, padding and unknown first."""
    return ["@@PADDING@@", "@@UNKNOWN@@", *dict.fromkeys(w for s in batch for w in s)]


def _cached_words() -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """WORDS' cached vocabulary, character ids and word ids."""
    vocab = _cache_vocab(WORDS)
    return vocab, batch_to_ids(WORDS), _word_ids(WORDS, vocab[2:])


@pytest.mark.slow
def test_bilm_layers_equal_allennlps_batch_after_batch(allennlp, bilm_files):
    """Its test_elmo_bilm: three batches of three, the state carried from one to the next."""
    from elmo_service.elmo import _ElmoBiLm

    options, weights = map(str, bilm_files)
    theirs = allennlp._ElmoBiLm(options, weights)
    ours = _ElmoBiLm(options, weights, stateful=True)
    assert ours.num_layers == theirs.num_layers == 3
    assert ours.get_output_dim() == theirs.get_output_dim()
    batches = [SENTENCES, [["a", "b"], ["river", "bank", "x", "y", "z"], ["."]], PAIR + [["z"]]]
    for batch in batches:
        ids = batch_to_ids(batch)
        with torch.no_grad():
            a, b = theirs(ids), ours(ids)
        assert torch.equal(a["mask"], b["mask"])
        assert [len(s) for s in batch] == (b["mask"].sum(1) - 2).tolist()
        _close(a["activations"], b["activations"])


@pytest.mark.slow
def test_the_cnn_cache_backs_off_for_words_it_does_not_hold(bilm_files):
    from elmo_service.elmo import _ElmoBiLm

    options, weights = bilm_files
    vocab = _cache_vocab([["here", "is"], ["a", "vocab"]])
    bilm = _ElmoBiLm(options, weights, vocab_to_cache=vocab).eval()
    plain = _ElmoBiLm(options, weights).eval()
    oov = [["This", "is", "OOV"], ["so", "is", "this"]]
    # ids past the cached table (another vocabulary's): the character CNN runs instead
    far = _word_ids(oov, _cache_vocab(oov)) + len(vocab)
    with torch.no_grad():
        got = bilm(batch_to_ids(oov), far)
        _close(plain(batch_to_ids(oov))["activations"], got["activations"])
        inside = [["here", "is"], ["a", "vocab"]]
        bilm(batch_to_ids(inside), _word_ids(inside, vocab[2:]))


@pytest.mark.slow
def test_cached_cnn_vectors_give_the_cnns_layers(bilm_files):
    from elmo_service.elmo import _ElmoBiLm

    vocab, ids, words = _cached_words()
    with torch.no_grad():
        # no cache: the word ids are ignored (its test passes the char ids there)
        plain = _ElmoBiLm(*bilm_files).eval()(ids, ids)
        cached = _ElmoBiLm(*bilm_files, vocab_to_cache=vocab).eval()(ids, words)
    assert torch.equal(plain["mask"], cached["mask"])
    for x, y in zip(plain["activations"], cached["activations"], strict=True):
        assert (x - y).abs().max() <= 1e-6 * max(1.0, float(x.abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_two_representations_and_their_shapes(bilm_files, keep):
    options, weights = bilm_files
    elmo = Elmo(options, weights, 2, dropout=0.0, keep_sentence_boundaries=keep)
    out = elmo(batch_to_ids(PAIR))
    t = 7 + 2 * keep  # the boundaries kept: two more positions
    assert [list(r.shape) for r in out["elmo_representations"]] == [[2, t, 32]] * 2
    assert list(out["mask"].shape) == [2, t]
    assert out["mask"].sum(1).tolist() == [3 + 2 * keep, 7 + 2 * keep]


@pytest.mark.slow
@pytest.mark.parametrize("stateful", [False, True])
def test_4d_input_equals_each_batch_run_alone(bilm_files, stateful):
    options, weights = bilm_files
    elmo = Elmo(options, weights, 2, dropout=0.0, stateful=stateful)
    groups = [
        PAIR,
        [["1", "2"], ["1", "2", "3", "4", "5", "6", "7"]],
        [["1", "2", "3", "4", "50", "60", "70"], ["The"]],
    ]
    each = [batch_to_ids(g) for g in groups]
    with torch.no_grad():
        four_d = elmo(torch.stack(each, dim=1))  # [2, 3, 7, 50]
        alone = []
        for ids in each:
            elmo._elmo_lstm._elmo_lstm.reset_states()  # where AllenNLP's test resets
            alone.append(elmo(ids))
    assert list(four_d["mask"].shape) == [2, 3, 7]
    for k in range(3):
        for j in range(2):
            x = four_d["elmo_representations"][j][:, k]
            assert (x - alone[k]["elmo_representations"][j]).abs().max() <= 1e-6
        assert torch.equal(four_d["mask"][:, k], alone[k]["mask"])


@pytest.mark.slow
def test_elmo_over_a_bilm_module(bilm_files):
    from elmo_service.elmo import _ElmoBiLm

    options, weights = bilm_files
    elmo = Elmo(None, None, 2, dropout=0.0, module=_ElmoBiLm(options, weights))
    ids = batch_to_ids(PAIR)
    with torch.no_grad():
        out = elmo(ids)["elmo_representations"]
        direct = Elmo(options, weights, 2, dropout=0.0)(ids)["elmo_representations"]
    assert [list(r.shape) for r in out] == [[2, 7, 32]] * 2
    _close(direct, out)


@pytest.mark.slow
def test_higher_dimensional_input_with_the_cnn_cache(bilm_files):
    options, weights = bilm_files
    vocab, ids, words = _cached_words()
    with torch.no_grad():
        one = Elmo(options, weights, 1, vocab_to_cache=vocab).eval()(ids, words)
        four = Elmo(options, weights, 1, vocab_to_cache=vocab).eval()(
            torch.stack([ids] * 4, dim=1), torch.stack([words] * 4, dim=1)
        )
    rep = four["elmo_representations"][0]
    assert list(rep.shape[:2]) == [3, 4]
    for k in range(4):
        assert (rep[:, k] - one["elmo_representations"][0]).abs().max() <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("requires_grad", [True, False])
def test_bilm_gradients_only_when_asked(bilm_files, requires_grad):
    options, weights = bilm_files
    elmo = Elmo(options, weights, 1, requires_grad=requires_grad)
    g = torch.Generator().manual_seed(0)
    elmo(torch.randint(0, 262, (3, 4, 50), generator=g))["elmo_representations"][0].sum().backward()
    grads = [p.grad for n, p in elmo.named_parameters() if n.startswith("_elmo_lstm.")]
    assert grads and all((g is not None) == requires_grad for g in grads)


@pytest.mark.slow
def test_character_encoder_equals_allennlps(allennlp, bilm_files):
    """Its test_elmo_token_representation: 457 words as 10 sentences of up to 50."""
    from elmo_service.elmo import _ElmoCharacterEncoder

    options, weights = map(str, bilm_files)
    g = torch.Generator().manual_seed(4)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,'-éü日本😀")
    words = [
        "".join(alphabet[int(i)] for i in torch.randint(0, len(alphabet), (n,), generator=g))
        for n in torch.randint(1, 60, (457,), generator=g).tolist()
    ]
    ids = batch_to_ids([words[k * 50 : (k + 1) * 50] for k in range(10)])
    ours = _ElmoCharacterEncoder(options, weights)
    assert ours.get_output_dim() == 16
    with torch.no_grad():
        a, b = allennlp._ElmoCharacterEncoder(options, weights)(ids), ours(ids)
    assert torch.equal(a["mask"], b["mask"]) and list(b["mask"].shape) == [10, 52]
    # inside each sentence: padding rows are the CNN of an empty token on both sides
    _close([a["token_embedding"]], [b["token_embedding"]])


@pytest.mark.slow
def test_character_encoder_boundaries_are_the_marker_tokens(bilm_files):
    from elmo_service.elmo import _ElmoCharacterEncoder

    enc = _ElmoCharacterEncoder(*bilm_files)
    with torch.no_grad():
        for position, token in ((0, "<S>"), (2, "</S>")):
            vectors = enc(batch_to_ids([[token]]))["token_embedding"]
            assert torch.allclose(vectors[0, position], vectors[0, 1], atol=1e-6)


@pytest.mark.slow
def test_the_inner_modules_load_allennlps_checkpoints_too(allennlp, bilm_files):
    from elmo_service.elmo import _ElmoBiLm, _ElmoCharacterEncoder

    options, weights = map(str, bilm_files)
    ids = batch_to_ids(SENTENCES)
    theirs = _moved(allennlp._ElmoCharacterEncoder(options, weights), seed=5)
    assert "_char_embedding_weights" in theirs.state_dict()
    enc = _ElmoCharacterEncoder(options, weights)
    enc.load_state_dict(theirs.state_dict(), strict=True)
    with torch.no_grad():
        _close([theirs(ids)["token_embedding"]], [enc(ids)["token_embedding"]])

    # AllenNLP's Elmo over its _ElmoBiLm module: ours over ours, the same checkpoint
    bilm = _moved(allennlp._ElmoBiLm(options, weights), seed=6)
    outer = allennlp.Elmo(None, None, 1, dropout=0.0, module=bilm)
    assert "_elmo_lstm._token_embedder.char_conv_0.weight" in outer.state_dict()
    mine = Elmo(None, None, 1, dropout=0.0, module=_ElmoBiLm(options, weights))
    mine.load_state_dict(outer.state_dict(), strict=True)
    _close(_reps(outer, ids), _reps(mine, ids))
    assert not any(k.startswith("_module.") for k in mine.state_dict())  # one copy, as there
    # earlier versions also wrote the module's weights under _module.: those still load
    old = dict(mine.state_dict())
    old.update({"_module." + k[len("_elmo_lstm.") :]: v for k, v in old.items() if "lstm." in k})
    again = Elmo(None, None, 1, dropout=0.0, module=_ElmoBiLm(options, weights))
    again.load_state_dict(old, strict=True)
    _close(_reps(mine, ids), _reps(again, ids))
    own = _ElmoBiLm(options, weights)  # and its own earlier state dicts
    own.load_state_dict(mine._elmo_lstm.state_dict(), strict=True)
    bilm._elmo_lstm.reset_states()  # AllenNLP's carries the state of the call above
    with torch.no_grad():
        _close(bilm(ids)["activations"], own(ids)["activations"])
