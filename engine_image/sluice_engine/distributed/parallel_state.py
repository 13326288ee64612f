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
import pickle
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
    control_group: object | None = None  # every rank, gloo: plain data from rank 0
    # Rank 0 and the rank that computes the logits (pipeline parallelism only). Its own communicator:
    # with NCCL, ops on one communicator run in order, and rank 0's sends of the next micro-batch's
    # hidden states would otherwise queue ahead of its receive of the last one's logits, while the last
    # stage's send of those logits queues ahead of its receive of those hidden states: a cycle.
    logits_group: object | None = None

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
    logits_group = dist.new_group([0, (pp - 1) * tp], backend=backend, timeout=timeout) if pp > 1 else None
    _state = ParallelState(rank, world, tp, pp, tp_group, control, logits_group)
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


# -- point to point: stages and plain data ----------------------------------------------------------
# Sends are asynchronous (isend), so a rank goes on with its next micro-batch while its last output
# travels: that is what lets pipeline stages overlap. Each kind of message has its own tag; between two
# ranks, messages of one tag arrive in the order they were sent, and every rank receives in step order.
CONTROL_TAG, HIDDEN_TAG, LOGITS_TAG = 1, 2, 3
_in_flight_sends: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive until sent)


def _isend(t: torch.Tensor, dst: int, tag: int, group=None) -> None:
    _in_flight_sends[:] = [(w, x) for w, x in _in_flight_sends if not w.is_completed()]
    _in_flight_sends.append((dist.isend(t, dst=dst, group=group, tag=tag), t))


def wait_sends() -> None:
    """Block until every send of this rank has left (before shutdown)."""
    for w, _ in _in_flight_sends:
        w.wait()
    _in_flight_sends.clear()


def send_hidden(hidden: torch.Tensor) -> None:
    """To the same TP rank of the next stage (every TP rank holds the whole, all-reduced stream)."""
    _isend(hidden.contiguous(), _state.rank + _state.tp, HIDDEN_TAG)


def recv_hidden(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=_state.rank - _state.tp, tag=HIDDEN_TAG)
    return buf


def last_stage_rank() -> int:
    """The rank that computes the logits: the last stage's first TP rank."""
    return (_state.pp - 1) * _state.tp


def send_logits(logits: torch.Tensor) -> None:
    _isend(logits.contiguous(), 0, LOGITS_TAG, _state.logits_group)


def recv_logits(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """On rank 0: the logits of the oldest step in flight. Every rank knows `shape` from the step's
    plain data, so no size is exchanged."""
    buf = torch.empty(shape, dtype=torch.float32, device=device)
    if shape[0]:
        dist.recv(buf, src=last_stage_rank(), group=_state.logits_group, tag=LOGITS_TAG)
    return buf


def send_control(obj: object) -> None:
    """Rank 0: `obj` (picklable plain data: a SchedulerOutput, a ping, None to stop) to every rank."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([len(data)], dtype=torch.long)
    for r in range(1, _state.world_size):
        _isend(size, r, CONTROL_TAG, _state.control_group)
        _isend(payload, r, CONTROL_TAG, _state.control_group)


def recv_control() -> object:
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src=0, group=_state.control_group, tag=CONTROL_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=0, group=_state.control_group, tag=CONTROL_TAG)
    return pickle.loads(payload.numpy().tobytes())


def all_ranks_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control_group)
    return int(t.item())
