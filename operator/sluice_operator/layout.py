"""Parallelism layout: how one replica of a model maps onto pods, devices and nodes.

A replica runs `tensor x pipeline` ranks, one process per device (one GPU each; on CPU, the ranks share the
pod's cores). The ranks spread evenly over `nodes` pods, each running one `sluice serve --nnodes N`: one pod
is a Deployment replica, more are a LeaderWorkerSet group of one pod per node. On GPUs the node count
defaults to as few nodes as hold the replica, `ceil(tensor x pipeline / gpusPerNode)`; on CPU (or without
gpusPerNode) to 1, and `parallelism.nodes` spreads the replica further.

A tensor-parallel group never spans nodes (its all-reduces need NVLink-class bandwidth), and every pod of a
group is identical (LWS has one worker template), so each node holds whole pipeline stages: the pipeline
size must be a multiple of the node count. The engine numbers ranks tensor-fastest, so node k holds stages
k x pipeline/nodes onwards. Data parallelism is the replica count.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallelism layout that cannot be placed."""


@dataclass(frozen=True, slots=True)
class Layout:
    tensor: int
    pipeline: int
    gpus_per_pod: int  # 0: CPU only
    pods_per_replica: int  # 1: a Deployment; > 1: the LeaderWorkerSet group size (nodes per replica)

    @property
    def multi_node(self) -> bool:
        return self.pods_per_replica > 1

    @property
    def gpus_per_replica(self) -> int:
        return self.gpus_per_pod * self.pods_per_replica

    @property
    def ranks(self) -> int:
        """Engine processes of one replica (torch.distributed world size): tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def ranks_per_pod(self) -> int:
        return self.ranks // self.pods_per_replica

    @property
    def distributed(self) -> bool:
        """More than one rank: the engine starts a torch.distributed group (NCCL on GPUs, gloo on CPU)."""
        return self.ranks > 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_layout(tensor: int, pipeline: int, gpus_per_node: int | None, *, cpu: bool = False,
                nodes: int | None = None) -> Layout:
    """The layout of one replica, or LayoutError saying which setting to change.

    `gpus_per_node=None` means "unknown": without `nodes`, the whole replica must then fit one pod.
    `nodes=None`: as few nodes as the GPUs need (1 on CPU).
    """
    if tensor < 1 or pipeline < 1:
        raise LayoutError(f"parallelism.tensor ({tensor}) and parallelism.pipeline ({pipeline}) must be >= 1")
    if nodes is not None and nodes < 1:
        raise LayoutError(f"parallelism.nodes ({nodes}) must be >= 1")
    if not cpu and gpus_per_node is not None and gpus_per_node < 1:
        raise LayoutError(f"accelerator.gpusPerNode ({gpus_per_node}) must be >= 1")
    ranks = tensor * pipeline
    if not cpu and gpus_per_node is not None and ranks > gpus_per_node and tensor > gpus_per_node:
        raise LayoutError(
            f"parallelism.tensor ({tensor}) exceeds accelerator.gpusPerNode ({gpus_per_node}): a tensor-parallel "
            "group runs on one node; span nodes with parallelism.pipeline instead"
        )
    if nodes is not None:
        if pipeline % nodes:
            raise LayoutError(
                f"parallelism.pipeline ({pipeline}) does not split evenly over parallelism.nodes ({nodes}): "
                "every node holds whole pipeline stages"
            )
        per_pod = ranks // nodes
        if not cpu and gpus_per_node is not None and per_pod > gpus_per_node:
            raise LayoutError(
                f"parallelism.nodes ({nodes}) is too few: {tensor}x{pipeline} GPUs would be {per_pod} per node, "
                f"more than accelerator.gpusPerNode ({gpus_per_node})"
            )
        return Layout(tensor, pipeline, gpus_per_pod=0 if cpu else per_pod, pods_per_replica=nodes)
    if cpu:
        return Layout(tensor, pipeline, gpus_per_pod=0, pods_per_replica=1)
    if gpus_per_node is None or ranks <= gpus_per_node:
        return Layout(tensor, pipeline, gpus_per_pod=ranks, pods_per_replica=1)
    n = ceil_div(ranks, gpus_per_node)
    if pipeline % n:
        raise LayoutError(
            f"parallelism.pipeline ({pipeline}) does not split evenly over the {n} nodes that "
            f"{tensor}x{pipeline} GPUs need at {gpus_per_node} per node; choose a pipeline size that is a "
            f"multiple of {n}, or set parallelism.nodes"
        )
    return Layout(tensor, pipeline, gpus_per_pod=ranks // n, pods_per_replica=n)
