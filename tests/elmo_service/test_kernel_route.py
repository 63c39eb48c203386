"""The per-machine route between the native biLSTM and the model's torch code, and the batched
recurrent product's library (elmo_service/bilm/kernels/calibrate.py): measured once, cached
per machine and shape, and whichever way it goes, the same vectors; the pack a route never
uses is not held."""

import json

import pytest
import torch

import elmo_service.bilm.kernels.calibrate as calibrate
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
from elmo_service.bilm.kernels.packed import EVERY_STEP, PackedLinear, onednn_available
from elmo_service.bilm.model import BiLM
from tests.support.configs import small_test_config


def model() -> BiLM:
    torch.manual_seed(0)
    return BiLM(small_test_config(lstm_dim=32, projection_dim=16)).eval()


def test_route_is_measured_once_cached_and_answers_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_KERNEL_CALIBRATION", "on")
    monkeypatch.setenv("ELMO_KERNEL_CACHE", str(tmp_path / "route.json"))
    monkeypatch.setattr(calibrate, "MIN_CELL_ELEMENTS", 0)  # measure even a tiny model
    monkeypatch.setattr(calibrate, "_memory", {})
    measured = []
    real = calibrate._measure
    monkeypatch.setattr(calibrate, "_measure", lambda k: measured.append(1) or real(k))
    bilm = model()
    kernel = CpuBiLM(bilm)
    kernel.warm_up()
    assert set(kernel.route) == {"one", "batch", "recurrent_rows"}
    assert {kernel.route["one"], kernel.route["batch"]} <= {"native", "torch"}
    rows = kernel.route["recurrent_rows"]
    assert rows in (*calibrate.RECURRENT_ROWS, EVERY_STEP)
    assert kernel.bilstm_kernel().layers[0][1].w_hh.transposed_below == rows  # applied
    stored = json.loads((tmp_path / "route.json").read_text())
    assert stored[calibrate.machine_key(bilm)] == kernel.route
    # a new process (empty memory) reads the file instead of measuring again
    monkeypatch.setattr(calibrate, "_memory", {})
    again = CpuBiLM(bilm)
    again.warm_up()
    assert again.route == kernel.route and len(measured) == 1
    # both routes, forced, give the same vectors
    g = torch.Generator().manual_seed(2)
    x, n = torch.randn(3, 7, 16, generator=g), torch.tensor([7, 4, 2])
    outs = []
    for way in ("native", "torch"):
        again.route = {"one": way, "batch": way}
        with torch.inference_mode():
            outs.append(again.contextualize(x, n))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5
    # and the batched product on oneDNN's pack or on W_hh^T (MKL): the same vectors
    again.route = {"one": "native", "batch": "native"}
    real_addmm, on_transposed = torch.addmm, []
    for rows in (0, EVERY_STEP):
        again.recurrent_rows = rows
        calls = []
        spy = lambda *a, calls=calls, **k: calls.append(1) or real_addmm(*a, **k)  # noqa: E731
        monkeypatch.setattr(torch, "addmm", spy)  # MKL's product with the input gates added
        with torch.inference_mode():
            outs.append(again.contextualize(x, n))
        monkeypatch.setattr(torch, "addmm", real_addmm)
        on_transposed.append(len(calls))
    # steps of one row run on W_hh^T either way; those of several too with the second
    assert on_transposed[1] > on_transposed[0]
    assert again.bilstm_kernel().layers[1][0].w_hh.transposed_below == EVERY_STEP
    assert (outs[2] - outs[3]).abs().max() <= 1e-5 and (outs[2] - outs[0]).abs().max() <= 1e-5


def test_an_old_route_without_the_recurrent_library_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_KERNEL_CALIBRATION", "on")
    monkeypatch.setenv("ELMO_KERNEL_CACHE", str(tmp_path / "route.json"))
    monkeypatch.setattr(calibrate, "MIN_CELL_ELEMENTS", 0)
    monkeypatch.setattr(calibrate, "_memory", {})
    bilm = model()
    old = {calibrate.machine_key(bilm): {"one": "native", "batch": "torch"}}
    (tmp_path / "route.json").write_text(json.dumps(old))
    kernel = CpuBiLM(bilm)
    kernel.warm_up()
    assert "recurrent_rows" in kernel.route
    stored = json.loads((tmp_path / "route.json").read_text())
    assert stored[calibrate.machine_key(bilm)] == kernel.route


def test_route_off_or_rounded_weights_stay_native(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_KERNEL_CACHE", str(tmp_path / "route.json"))
    monkeypatch.setattr(calibrate, "MIN_CELL_ELEMENTS", 0)
    monkeypatch.setattr(calibrate, "_memory", {})
    monkeypatch.setenv("ELMO_KERNEL_CALIBRATION", "off")
    kernel = CpuBiLM(model())
    kernel.warm_up()
    assert kernel.route == {}
    monkeypatch.setenv("ELMO_KERNEL_CALIBRATION", "on")
    rounded = CpuBiLM(model(), weights="bf16")
    rounded.warm_up()
    assert rounded.route == {} and not (tmp_path / "route.json").exists()


def test_every_step_on_w_transposed_lets_the_pack_go_and_builds_it_again_if_asked():
    """A machine whose route multiplies every step on ``W_hh^T`` holds no oneDNN pack of it
    (2 MiB a layer and direction for the bundled model, twice with the express thread)."""
    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 64, generator=g)  # wide: oneDNN's pack for several rows
    lin = PackedLinear(w)
    lin.use_transposed(w.t().contiguous())
    lin.pack_now()
    assert lin._onednn is None  # W^T is held: the pack waits for its first use
    x, add = torch.randn(8, 64, generator=g), torch.randn(8, 512, generator=g)
    on_pack = lin(x, add=add)
    assert lin._onednn is not None
    lin.transposed_below = EVERY_STEP
    assert lin._onednn is None  # let go
    on_wt = lin(x, add=add)
    assert lin._onednn is None  # W^T ran
    lin.transposed_below = 0  # a route that changes back: the pack again, from W^T
    again = lin(x, add=add, out=torch.empty(8, 512))
    assert lin._onednn is not None
    assert (on_pack - on_wt).abs().max() <= 1e-5 and torch.equal(on_pack, again)
