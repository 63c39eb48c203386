"""The per-machine route between the native biLSTM and the model's torch code
(elmo_service/bilm/kernels/calibrate.py): measured once, cached per machine and shape, and
whichever way it goes, the same vectors."""

import json

import torch

import elmo_service.bilm.kernels.calibrate as calibrate
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM
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
    assert set(kernel.route) == {"one", "batch"}
    assert set(kernel.route.values()) <= {"native", "torch"}
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
