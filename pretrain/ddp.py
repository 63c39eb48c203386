"""What the trainer does across DDP ranks besides the gradients' all-reduce: the process
group, barriers, every rank's RNG state gathered into a checkpoint, stream mode's carried
LSTM rows gathered (to save) and scattered (on resume), and the replicas' sanity check.

Single-process (``world == 1``) every function is the plain local answer, so the trainer
calls them without branches."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# stream mode's carried state: direction -> layers -> (h, c), each [rows, dim]
LstmState = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]


def dist_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) from the variables torchrun sets."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def init_group(device: torch.device, world: int) -> None:
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def broadcast_from_first(t: torch.Tensor, world: int) -> torch.Tensor:
    """Rank 0's ``t`` on every rank (in place)."""
    if world > 1:
        dist.broadcast(t, 0)
    return t


def gather_rng_states(world: int) -> list[torch.Tensor]:
    """Every rank's torch CPU RNG state ([n] uint8 each), gathered to all, in rank order."""
    state = torch.get_rng_state()
    if world == 1:
        return [state]
    out = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(out, state)
    return out


def gather_stream_state(
    state: LstmState | None,
    directions: list[str],
    n_layers: int,
    dims: tuple[int, int],
    rows: int,
    device: torch.device,
    world: int,
) -> dict[str, list[list[torch.Tensor]]]:
    """Stream mode: the carried state, every rank's rows stacked in rank order (CPU);
    zeros where nothing is carried yet. ``dims``: (projection, cell) sizes."""
    out: dict[str, list[list[torch.Tensor]]] = {}
    for d in directions:
        layers = []
        for i in range(n_layers):
            pair = []
            for k, dim in enumerate(dims):
                t = (
                    torch.zeros(rows, dim, device=device)
                    if state is None
                    else state[d][i][k].float()
                )
                if world > 1:
                    parts = [torch.empty_like(t) for _ in range(world)]
                    dist.all_gather(parts, t.contiguous())
                    t = torch.cat(parts)
                pair.append(t.cpu())
            layers.append(pair)
        out[d] = layers
    return out


def scatter_stream_state(
    saved: dict[str, list[list[torch.Tensor]]], rank: int, rows: int, device: torch.device
) -> LstmState:
    """This rank's rows of a gathered state (``gather_stream_state``), on ``device``."""
    sl = slice(rank * rows, (rank + 1) * rows)
    return {
        d: [(h[sl].to(device), c[sl].to(device)) for h, c in layers] for d, layers in saved.items()
    }


def params_identical(model: torch.nn.Module, world: int, device: torch.device) -> bool:
    """Every rank holds bit-identical parameters (per-tensor sums and squares compared)."""
    with torch.no_grad():
        sums = torch.stack(
            [torch.stack([p.double().sum(), p.double().square().sum()]) for p in model.parameters()]
        )
    sums = sums.flatten().to(device)
    gathered = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(gathered, sums)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])
