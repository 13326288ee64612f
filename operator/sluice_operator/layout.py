"""Parallelism layout: how one replica of a model maps onto pods, GPUs and nodes.

A replica holds `tensor x pipeline` GPUs. When they fit one node it is one pod (a Deployment replica);
otherwise it is a LeaderWorkerSet group of `ceil(tensor x pipeline / gpusPerNode)` pods, one per node.
A tensor-parallel group never spans nodes (its all-reduces need NVLink-class bandwidth), and every pod of
a group is identical (LWS has one worker template), so the pipeline stages must split evenly over the
nodes. Data parallelism is the replica count.
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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_layout(tensor: int, pipeline: int, gpus_per_node: int | None, *, cpu: bool = False) -> Layout:
    """The layout of one replica, or LayoutError saying which setting to change.

    `gpus_per_node=None` means "unknown": the whole replica must then fit one pod.
    """
    if tensor < 1 or pipeline < 1:
        raise LayoutError(f"parallelism.tensor ({tensor}) and parallelism.pipeline ({pipeline}) must be >= 1")
    if cpu:
        if tensor * pipeline != 1:
            raise LayoutError(
                "a CPU-only endpoint (accelerator.type: cpu) runs on one device: "
                f"parallelism.tensor ({tensor}) and parallelism.pipeline ({pipeline}) must be 1"
            )
        return Layout(1, 1, gpus_per_pod=0, pods_per_replica=1)
    gpus = tensor * pipeline
    if gpus_per_node is None or gpus <= gpus_per_node:
        return Layout(tensor, pipeline, gpus_per_pod=gpus, pods_per_replica=1)
    if gpus_per_node < 1:
        raise LayoutError(f"accelerator.gpusPerNode ({gpus_per_node}) must be >= 1")
    if tensor > gpus_per_node:
        raise LayoutError(
            f"parallelism.tensor ({tensor}) exceeds accelerator.gpusPerNode ({gpus_per_node}): a tensor-parallel "
            "group runs on one node; span nodes with parallelism.pipeline instead"
        )
    nodes = ceil_div(gpus, gpus_per_node)
    if pipeline % nodes:
        raise LayoutError(
            f"parallelism.pipeline ({pipeline}) does not split evenly over the {nodes} nodes that "
            f"{tensor}x{pipeline} GPUs need at {gpus_per_node} per node; choose a pipeline size that is a "
            f"multiple of {nodes}"
        )
    return Layout(tensor, pipeline, gpus_per_pod=gpus // nodes, pods_per_replica=nodes)
