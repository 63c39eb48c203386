"""The one door to the biLM (``elmo_service/bilm/runner.py``): its three ways to run agree
with the model's own code, and the carried state behaves as AllenNLP's ``_EncoderBase``."""

from __future__ import annotations

import pytest
import torch

from elmo_service.bilm.kernels.select import TorchBiLM
from elmo_service.bilm.model import BiLM
from elmo_service.bilm.runner import CarriedState, Runner
from elmo_service.errors import InputError
from tests.support.configs import small_test_config

TOL = 1e-5
CPU = torch.device("cpu")


def random_bilm(seed: int = 0) -> BiLM:
    torch.manual_seed(seed)
    cfg = small_test_config(lstm_dim=32, projection_dim=16, cell_clip=0.8, proj_clip=0.5)
    model = BiLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_a_batch_from_carried_state_continues_each_row():
    """Call 2 from call 1's state equals the model's own contextualize_from from that
    state; a row past a smaller call keeps its state; a reset row starts from zero."""
    model = random_bilm()
    runner = Runner(model, device=CPU)
    carried = CarriedState()
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(3, 6, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    la, lb = torch.tensor([6, 4, 5]), torch.tensor([5, 3])
    with torch.inference_mode():
        first = runner.run_from(a, la, carried)
        assert torch.allclose(first, model.contextualize(a, la), atol=TOL)  # zero state
        assert carried.rows == 3
        _, final_a = model.contextualize_from(a, la)
        start = tuple([(h[:2], c[:2]) for h, c in d] for d in final_a)
        want, _ = model.contextualize_from(b, lb, start)
        kept_row = carried.stored[0][:, :, 2].clone()
        second = runner.run_from(b, lb, carried)
    assert torch.allclose(second, want, atol=TOL)
    assert not torch.allclose(second, model.contextualize(b, lb), atol=1e-3)  # state mattered
    assert torch.equal(carried.stored[0][:, :, 2], kept_row)  # row 2 was not in call 2
    carried.reset(torch.tensor([True, False, False]))
    assert float(carried.stored[0][:, :, 0].abs().max()) == 0.0
    assert float(carried.stored[0][:, :, 1].abs().max()) > 0.0
    with pytest.raises(InputError) as e:
        carried.reset(torch.tensor([True]))
    assert e.value.field == "mask"
    carried.reset()
    assert carried.rows == 0 and carried.initial(2) is None


@pytest.mark.parametrize(
    ("weights", "torch_kernel"), [("fp32", False), ("int8", False), ("fp32", True)]
)
def test_a_stream_of_rows_together_equals_each_row_alone(weights, torch_kernel):
    """Rows of different lengths in one batched step, chunk after chunk, give each row what
    it gets streamed alone (the native row loop), and the whole sequence in one pass."""
    model = random_bilm()
    runner = Runner(model, device=CPU, weights=weights)
    if torch_kernel:
        runner.kernel = TorchBiLM(model)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randn(n, 16, generator=g) for n in (23, 9, 1, 17)]
    chunk = 5

    def streamed(rows: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each row's forward and backward outputs of the top layer, chunk by chunk."""
        states = {r: runner.stream_state() for r in rows}
        fw = {r: [] for r in rows}
        bw = {r: [] for r in rows}
        k = 0
        while True:
            live = [r for r in rows if k * chunk < len(seqs[r])]
            if not live:
                break
            inputs = []
            for r in live:
                x = seqs[r]
                lo, hi = k * chunk, min((k + 1) * chunk, len(x))
                rev = x.flip(0)
                inputs.append((x[lo:hi], rev[lo:hi]))
            with runner.session():
                outs = runner.stream(inputs, [states[r] for r in live])
            for r, (f, b) in zip(live, outs, strict=True):
                fw[r].append(f[-1].clone())
                bw[r].append(b[-1].clone())
            k += 1
        return {r: (torch.cat(fw[r]), torch.cat(bw[r]).flip(0)) for r in rows}

    together = streamed([0, 1, 2, 3])
    for r, x in enumerate(seqs):
        alone = streamed([r])[r]
        with torch.inference_mode():
            whole = runner.contextualize(x[None], torch.tensor([len(x)]))[-1, 0]
        p = x.shape[1]
        for got in (together[r], alone):
            assert torch.allclose(got[0], whole[:, :p], atol=TOL)
            assert torch.allclose(got[1], whole[:, p:], atol=TOL)
