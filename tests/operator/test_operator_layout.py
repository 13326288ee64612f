"""Parallelism layout maths: GPUs per pod and LeaderWorkerSet group size."""

from __future__ import annotations

import itertools

import pytest

from sluice_operator.layout import LayoutError, ceil_div, plan_layout


@pytest.mark.parametrize(("tensor", "pipeline", "gpus_per_node", "gpus_per_pod", "pods"), [
    (1, 1, None, 1, 1),
    (4, 1, None, 4, 1),  # unknown node size: the replica must fit one pod
    (2, 2, None, 4, 1),
    (4, 1, 8, 4, 1),
    (4, 2, 8, 8, 1),  # tensor x pipeline == gpusPerNode: still one pod
    (8, 2, 8, 8, 2),  # the 70B example: an LWS group of 2 nodes x 8 GPUs
    (4, 4, 8, 8, 2),
    (8, 4, 8, 8, 4),
    (2, 4, 4, 4, 2),
    (1, 3, 1, 1, 3),
    (2, 6, 8, 6, 2),  # 12 GPUs need ceil(12/8) = 2 nodes: 3 stages of 2 GPUs on each
    (3, 3, 4, 3, 3),
])
def test_layouts(tensor, pipeline, gpus_per_node, gpus_per_pod, pods):
    layout = plan_layout(tensor, pipeline, gpus_per_node)
    assert (layout.gpus_per_pod, layout.pods_per_replica) == (gpus_per_pod, pods)
    assert layout.multi_node == (pods > 1)
    assert layout.gpus_per_replica == tensor * pipeline
    assert layout.ranks_per_pod == gpus_per_pod  # one rank per GPU


@pytest.mark.parametrize(("tensor", "pipeline", "gpus_per_node", "message"), [
    (16, 1, 8, r"parallelism.tensor \(16\) exceeds accelerator.gpusPerNode \(8\)"),
    (16, 2, 8, "a tensor-parallel group runs on one node"),
    (4, 3, 8, r"parallelism.pipeline \(3\) does not split evenly over the 2 nodes"),
    (2, 3, 4, "does not split evenly"),
])
def test_unplaceable_layouts(tensor, pipeline, gpus_per_node, message):
    with pytest.raises(LayoutError, match=message):
        plan_layout(tensor, pipeline, gpus_per_node)


def test_cpu_layout():
    layout = plan_layout(1, 1, None, cpu=True)
    assert (layout.gpus_per_pod, layout.pods_per_replica, layout.multi_node) == (0, 1, False)
    assert not layout.distributed
    # Ranks on CPU share the pod's cores (gloo); the pod asks for no GPU.
    layout = plan_layout(3, 2, None, cpu=True)
    assert (layout.gpus_per_pod, layout.pods_per_replica, layout.ranks_per_pod) == (0, 1, 6)
    assert layout.distributed and not layout.multi_node
    # parallelism.nodes spreads a CPU replica's pipeline stages over pods: the kind e2e's two-node case.
    layout = plan_layout(1, 2, None, cpu=True, nodes=2)
    assert (layout.gpus_per_pod, layout.pods_per_replica, layout.ranks_per_pod) == (0, 2, 1)
    assert layout.multi_node and layout.gpus_per_replica == 0
    with pytest.raises(LayoutError, match=r"pipeline \(3\) does not split evenly over parallelism.nodes \(2\)"):
        plan_layout(1, 3, None, cpu=True, nodes=2)


@pytest.mark.parametrize(("tensor", "pipeline", "gpus_per_node", "nodes", "gpus_per_pod", "pods"), [
    (8, 2, 8, 2, 8, 2),  # what the default gives
    (2, 2, 8, 2, 2, 2),  # wider than needed: two pods of 2 GPUs
    (2, 4, None, 4, 2, 4),  # without gpusPerNode
    (2, 5, 4, 5, 2, 5),  # 10 GPUs at 4 per node: the default (3 nodes) cannot split 5 stages, 5 nodes can
    (4, 2, 8, 1, 8, 1),
])
def test_explicit_nodes(tensor, pipeline, gpus_per_node, nodes, gpus_per_pod, pods):
    layout = plan_layout(tensor, pipeline, gpus_per_node, nodes=nodes)
    assert (layout.gpus_per_pod, layout.pods_per_replica) == (gpus_per_pod, pods)
    assert layout.gpus_per_replica == layout.ranks == tensor * pipeline


def test_explicit_nodes_refused():
    with pytest.raises(LayoutError, match=r"parallelism.nodes \(1\) is too few: 4x4 GPUs would be 16 per node"):
        plan_layout(4, 4, 8, nodes=1)
    with pytest.raises(LayoutError, match="every node holds whole pipeline stages"):
        plan_layout(2, 4, 8, nodes=3)
    with pytest.raises(LayoutError, match=r"parallelism.tensor \(16\) exceeds"):
        plan_layout(16, 2, 8, nodes=2)


def test_invariants_over_a_grid():
    placed = 0
    for tensor, pipeline, gpn in itertools.product(range(1, 17), range(1, 9), [None, 1, 2, 4, 8]):
        try:
            layout = plan_layout(tensor, pipeline, gpn)
        except LayoutError:
            assert gpn is not None and tensor * pipeline > gpn  # only multi-node layouts are refused
            continue
        placed += 1
        total = tensor * pipeline
        assert layout.gpus_per_pod * layout.pods_per_replica == total
        assert layout.gpus_per_pod % tensor == 0  # a tensor group never spans pods
        if gpn is None or total <= gpn:
            assert layout.pods_per_replica == 1
        else:
            assert layout.gpus_per_pod <= gpn
            assert layout.pods_per_replica == ceil_div(total, gpn)
            assert pipeline % layout.pods_per_replica == 0
    assert placed > 200
