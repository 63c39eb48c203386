"""Precision choice: ``auto`` follows the hardware, explicit choices are kept; model loads
run on threads that end."""

import asyncio
import logging
import threading

import pytest
import torch

from elmo_service import runtime
from elmo_service.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "want"), [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_only_where_native(monkeypatch, native, want):
    monkeypatch.setattr(runtime, "native_bf16", lambda device: native)
    assert runtime.resolve_precision(CPU, "auto") == want


def test_explicit_bf16_is_kept_but_warned_where_emulated(monkeypatch, caplog):
    monkeypatch.setattr(runtime, "native_bf16", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="elmo_service.runtime"):
        assert runtime.resolve_precision(CPU, "bf16") == "bf16"
    assert "emulated" in caplog.text
    caplog.clear()
    monkeypatch.setattr(runtime, "native_bf16", lambda device: True)
    with caplog.at_level(logging.WARNING, logger="elmo_service.runtime"):
        assert runtime.resolve_precision(CPU, "bf16") == "bf16"
    assert caplog.text == ""


def test_native_bf16_reads_this_cpu():
    # the real probe, not a mock: a bool, and the same answer as oneDNN's
    assert runtime.native_bf16(CPU) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("bad", ["fp8", "", "BF16"])
def test_unknown_precision_names_the_field(bad):
    with pytest.raises(ConfigError) as e:
        runtime.resolve_precision(CPU, bad)
    assert e.value.field == "precision"


def test_fp16_needs_cuda_and_autocast_needs_a_resolved_precision():
    with pytest.raises(ConfigError, match="CUDA"):
        runtime.resolve_precision(CPU, "fp16")
    with pytest.raises(ConfigError, match="resolve"):
        runtime.autocast(CPU, "auto")


def test_in_transient_thread_returns_and_raises_on_the_caller():
    names: list[str] = []

    def work(x, *, y):
        names.append(threading.current_thread().name)
        return x + y

    assert runtime.in_transient_thread(work, 1, y=2) == 3
    assert names == ["elmo-load"]
    with pytest.raises(ZeroDivisionError):
        runtime.in_transient_thread(lambda: 1 / 0)
    assert asyncio.run(runtime.in_transient_thread_async(work, 2, y=3)) == 5
    with pytest.raises(KeyError):
        asyncio.run(runtime.in_transient_thread_async({}.__getitem__, "k"))
