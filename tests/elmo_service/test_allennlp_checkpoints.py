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
from tests.support.bilm_fixtures import write_bilm

SENTENCES = [["The", "bank", "of", "the", "river", "."], ["naïve", "café"], ["a"]]
TOL = 1e-5


@pytest.fixture(scope="module")
def allennlp():
    from tests.support.allennlp_shim import import_allennlp_elmo

    try:
        return import_allennlp_elmo()
    except ImportError as e:  # pragma: no cover - the message is the point
        pytest.fail(f"AllenNLP is not importable ({e}); run tests/install_parity_deps.sh")


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
