"""Checkpoints written by AllenNLP's ``Elmo`` load into ours after the import swap (#55).

A model built with ``allennlp.modules.elmo.Elmo`` and saved with ``state_dict()`` -- alone,
or inside a tagger -- loads into the same model built with ``elmo_service.Elmo`` (strict),
and then answers what AllenNLP's answered. The AllenNLP side is the real package
(tests/install_parity_deps.sh), on random-weight bilm-tf files; ours starts from *other*
weights, so only the loaded checkpoint can make the two agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elmo_service import Elmo
from tests.support.bilm_fixtures import write_bilm

pytestmark = pytest.mark.slow  # imports AllenNLP

SENTENCES = [["The", "bank", "of", "the", "river", "."], ["naïve", "café"], ["a"]]
TOL = 1e-4


@pytest.fixture(scope="module")
def allennlp_elmo():
    from tests.support.allennlp_shim import import_allennlp_elmo

    return import_allennlp_elmo()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bilm")
    theirs = write_bilm(tmp / "a", n_characters=262, n_highway=2, seed=3)
    other = write_bilm(tmp / "b", n_characters=262, n_highway=2, seed=11)
    return theirs, other


def _theirs(allennlp_elmo, files, n=2):
    options, weights = files[0]
    torch.manual_seed(0)
    e = allennlp_elmo.Elmo(str(options), str(weights), n, dropout=0.0)
    with torch.no_grad():  # mixes that are not the initial ones, so their mapping shows
        for k in range(n):
            mix = getattr(e, f"scalar_mix_{k}")
            for j, p in enumerate(mix.scalar_parameters):
                p.fill_(0.3 * (j + 1) * (k + 1))
            mix.gamma.fill_(0.7 + k)
    return e.eval()


def _run(elmo, ids):
    with torch.no_grad():
        return elmo(ids)["elmo_representations"]


def test_an_allennlp_elmo_state_dict_loads_strictly_and_answers_the_same(allennlp_elmo, files):
    theirs = _theirs(allennlp_elmo, files)
    sd = theirs.state_dict()
    assert any(k.startswith("_elmo_lstm._elmo_lstm.forward_layer_0") for k in sd)
    ours = Elmo(*map(str, files[1]), 2, dropout=0.0).eval()
    ids = allennlp_elmo.batch_to_ids(SENTENCES)
    before = _run(ours, ids)
    ours.load_state_dict(sd, strict=True)
    after, want = _run(ours, ids), _run(theirs, ids)
    for a, b, w in zip(before, after, want, strict=True):
        assert (b - w).abs().max() <= TOL
        assert (a - w).abs().max() > 100 * TOL  # the other weights really differed
    # our own checkpoint still loads as before
    again = Elmo(*map(str, files[1]), 2, dropout=0.0).eval()
    again.load_state_dict(ours.state_dict(), strict=True)
    for a, b in zip(_run(again, ids), after, strict=True):
        assert torch.equal(a, b)


class Tagger(nn.Module):
    def __init__(self, elmo: nn.Module) -> None:
        super().__init__()
        self.elmo = elmo
        self.tag = nn.Linear(elmo.get_output_dim(), 5)

    def forward(self, ids):
        return self.tag(self.elmo(ids)["elmo_representations"][0])


def test_a_model_that_held_allennlps_elmo_loads_after_the_import_swap(allennlp_elmo, files):
    torch.manual_seed(1)
    theirs = Tagger(_theirs(allennlp_elmo, files, n=1)).eval()
    ours = Tagger(Elmo(*map(str, files[1]), 1, dropout=0.0)).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ids = allennlp_elmo.batch_to_ids(SENTENCES)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids)).abs().max() <= TOL


def test_a_checkpoint_missing_a_layer_is_refused_by_strict_loading(allennlp_elmo, files):
    sd = _theirs(allennlp_elmo, files).state_dict()
    del sd["_elmo_lstm._elmo_lstm.backward_layer_0.state_projection.weight"]
    ours = Elmo(*map(str, files[1]), 2)
    with pytest.raises(RuntimeError, match="backward_layers.0.w_proj.weight"):
        ours.load_state_dict(sd, strict=True)
