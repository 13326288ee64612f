"""The process groups of this rank, and the few collectives the model calls.

One process per rank. Every rank joins the world with torch.distributed (NCCL on CUDA, gloo on CPU)
and one gloo group over all ranks for plain data (the step's SchedulerOutput, pings): objects are
pickled into CPU tensors, which NCCL would force through the device. Each pipeline stage's TP ranks
form a TP group for the all-reduces and the logits gather. When nothing is initialized (one process,
the common case) every collective is a no-op and the model runs exactly as unsharded code.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("sluice.engine")


@dataclass(slots=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    tp_group: object | None = None  # this stage's TP ranks (device backend)
    control_group: object | None = None  # every rank, gloo: plain-data broadcasts

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_group_ranks(self) -> list[int]:
        first = self.pp_rank * self.tp
        return list(range(first, first + self.tp))


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def init_distributed(rank: int, tp: int, pp: int, master_addr: str, master_port: int, device: torch.device,
                     timeout_s: float, local_rank: int = 0) -> ParallelState:
    """Join the group of tp x pp ranks (blocks until every rank has joined) and build the TP groups."""
    global _state
    world = tp * pp
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=timeout)
    # new_group is collective: every rank creates every group, in the same order.
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    tp_group = None
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            tp_group = group
    _state = ParallelState(rank, world, tp, pp, tp_group, control)
    log.info("rank %d of %d joined (%s; TP %d x PP %d; stage %d, TP rank %d)", rank, world, backend, tp, pp,
             _state.pp_rank, _state.tp_rank)
    return _state


def destroy_distributed() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


# -- the model's collectives --------------------------------------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (in place); the identity with one TP rank."""
    if _state.tp > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate the TP ranks' slices of x's last dimension on the group's first rank (None on the
    others); x itself with one TP rank."""
    s = _state
    if s.tp == 1:
        return x
    x = x.contiguous()
    dst = s.tp_group_ranks[0]
    if s.rank == dst:
        parts = [torch.empty_like(x) for _ in range(s.tp)]
        dist.gather(x, parts, dst=dst, group=s.tp_group)
        return torch.cat(parts, dim=-1)
    dist.gather(x, None, dst=dst, group=s.tp_group)
    return None


# -- pipeline stages ----------------------------------------------------------------------------
def send_hidden(hidden: torch.Tensor) -> None:
    """To the same TP rank of the next stage (every TP rank holds the whole, all-reduced stream)."""
    dist.send(hidden.contiguous(), dst=_state.rank + _state.tp)


def recv_hidden(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=_state.rank - _state.tp)
    return buf


def logits_to_rank0(logits: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """The logits, computed on the last stage's first TP rank, on rank 0 (which samples); None on the
    other ranks. Every rank knows `shape` from the step's plain data, so no size is exchanged."""
    s = _state
    if shape[0] == 0:
        return torch.empty(shape, dtype=torch.float32, device=device) if s.rank == 0 else None
    if s.pp == 1:
        return logits if s.rank == 0 else None
    src = (s.pp - 1) * s.tp
    if s.rank == src:
        dist.send(logits.contiguous(), dst=0)
    elif s.rank == 0:
        buf = torch.empty(shape, dtype=torch.float32, device=device)
        dist.recv(buf, src=src)
        return buf
    return None


# -- plain data from rank 0 ---------------------------------------------------------------------
def broadcast_from_rank0(obj: object = None) -> object:
    """Rank 0 sends `obj` (picklable plain data) to every rank; the others get it back."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_state.control_group)
    return box[0]


def all_ranks_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control_group)
    return int(t.item())
