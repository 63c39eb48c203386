"""The weights watch (``elmo_service/bilm/layer_cache.py`` ``WeightsWatch``) costs integer
reads per weight, never a pass over the weights (#57: it was +153 % at batch 1), and still
sees every write: what ``tests/elmo_service/test_elmo_integrity.py`` holds for each kind
of write, and here the handles that outlive one statement (a ``.data`` tensor kept and
written later, a numpy array, the tensor given to ``.data = ...``), modules that share one
biLM, and what pickling and copying leave behind. No timing: the cost is counted in
content reads."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from elmo_service import Elmo, batch_to_ids
from elmo_service.bilm import layer_cache
from elmo_service.bilm.layer_cache import WatchedParameter, WeightsWatch
from tests.support.core_fixtures import tiny_model

SENTENCES = [["The", "bank", "of", "the", "river", "."], ["naïve", "café"]]


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Each content read of a weight the watch makes (its size)."""
    seen: list[int] = []
    real = layer_cache._fingerprint

    def counted(t):
        seen.append(t.numel())
        return real(t)

    monkeypatch.setattr(layer_cache, "_fingerprint", counted)
    return seen


def _elmo(bilm=None) -> Elmo:
    bilm = bilm if bilm is not None else tiny_model(filters=((1, 4), (2, 8)), n_highway=1)
    return Elmo(None, None, 1, bilm=bilm, dropout=0.0).eval()


def _out(elmo: Elmo) -> torch.Tensor:
    with torch.no_grad():
        return elmo(batch_to_ids(SENTENCES))["elmo_representations"][0]


def _fresh(elmo: Elmo) -> torch.Tensor:
    return _out(_elmo(copy.deepcopy(elmo._elmo_lstm)))


def _weight(elmo: Elmo) -> nn.Parameter:
    return elmo._elmo_lstm.get_parameter("forward_layers.0.w_hh.weight")


def test_a_forward_reads_no_weight_once_nothing_went_out(reads):
    elmo = _elmo()
    _out(elmo)
    kernel = elmo._kernel
    reads.clear()
    for _ in range(5):
        _out(elmo)
    assert reads == [] and elmo._kernel is kernel
    assert all(isinstance(p, WatchedParameter) for p in elmo._elmo_lstm.parameters())


def test_a_data_read_costs_one_look_at_that_weight_and_keeps_the_kernel(reads):
    elmo = _elmo()
    _out(elmo)
    kernel = elmo._kernel
    p = _weight(elmo)
    reads.clear()
    norm = float(p.data.norm())  # read, not written: the handle dies at once
    assert norm > 0 and reads == [p.numel()]  # the fingerprint when it went out
    _out(elmo)
    assert reads == [p.numel()] * 2 and elmo._kernel is kernel  # one look: unchanged
    _out(elmo)
    assert len(reads) == 2  # nothing out any more: integer reads only


def test_a_kept_data_tensor_written_later_is_seen_every_time(reads):
    elmo = _elmo()
    held = _weight(elmo).data
    before = _out(elmo)
    for scale in (0.5, 3.0):
        held.mul_(scale)  # no version bump on the parameter, long after .data was read
        after = _out(elmo)
        assert torch.allclose(after, _fresh(elmo), atol=1e-5)
        assert float((after - before).abs().max()) > 1e-4
        before = after
    del held
    _out(elmo)
    reads.clear()
    _out(elmo)
    assert reads == []  # the handle is gone: back to integer reads


def test_numpy_views_and_assigned_tensors_are_followed():
    elmo = _elmo()
    p = _weight(elmo)
    before = _out(elmo)
    view = p.numpy()  # frozen weights: numpy shares the storage, no version counter
    view[0, :] += 1.0
    after = _out(elmo)
    assert torch.allclose(after, _fresh(elmo), atol=1e-5) and not torch.equal(after, before)
    other = p.detach().clone()
    p.data = other  # the storage is now ``other``'s, written through it later
    _out(elmo)
    other.mul_(0.25)
    got = _out(elmo)
    assert torch.allclose(got, _fresh(elmo), atol=1e-5) and not torch.allclose(got, after)


def test_modules_sharing_one_bilm_each_see_a_data_write():
    bilm = tiny_model(filters=((1, 4), (2, 8)), n_highway=1)
    a, b = _elmo(bilm), _elmo(bilm)
    _out(a), _out(b)
    bilm.get_parameter("token_encoder.projection.weight").data.mul_(2.0)
    want = _out(_elmo(copy.deepcopy(bilm)))
    assert torch.allclose(_out(a), want, atol=1e-5)  # a's look finds the change...
    assert torch.allclose(_out(b), want, atol=1e-5)  # ...and b sees it too


def test_watched_weights_pickle_copy_and_print_as_plain_parameters():
    elmo = _elmo()
    want = _out(elmo)
    p = _weight(elmo)
    assert repr(p).startswith("Parameter containing:\ntensor(")
    back = pickle.loads(pickle.dumps(elmo))
    assert type(_weight(back)) is nn.Parameter
    buf = io.BytesIO()
    torch.save(elmo, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    for other in (back, saved, copy.deepcopy(elmo)):
        assert torch.allclose(_out(other), want, atol=1e-6)
    state = elmo.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())


def test_a_plain_tensor_and_an_unswappable_one_are_watched():
    t = torch.randn(3, 300)
    watch = WeightsWatch()
    assert watch.changed([t]) and not watch.changed([t])
    np.asarray(t)[1, 290] = 5.0  # numpy through __array__
    assert watch.changed([t]) and not watch.changed([t])

    class Odd(nn.Parameter):
        __slots__ = ("extra",)  # a layout of its own: no watched class can replace it

    odd = Odd(torch.randn(4, 4), requires_grad=False)
    assert watch.changed([odd]) and not watch.changed([odd])
    odd.data[0, 0] += 1.0
    assert watch.changed([odd])
