"""The graph runner alone decides eager breaks: non-capturable groups are wrapped, and their
layers run the gathers-first schedule. Outside a capture the wrapper is the group (CPU)."""

from __future__ import annotations

import torch

from dsv4cp.cp import FakeCPWorld, SingleCPGroup, run_ranks
from dsv4cp.graphs.runner import EagerBreakCPGroup, GraphConfig, GraphRunner


def test_only_non_capturable_groups_get_breaks() -> None:
    single = SingleCPGroup()
    gr = GraphRunner(GraphConfig(), single)
    assert gr.cp is single and gr.overlap_gathers
    fake = FakeCPWorld(2).group(0)
    gr = GraphRunner(GraphConfig(), fake)
    assert isinstance(gr.cp, EagerBreakCPGroup) and gr.cp.inner is fake
    assert not gr.overlap_gathers and not gr.cp.capturable
    assert (gr.cp.cp_size, gr.cp.rank) == (2, 0)


def test_wrapper_gathers_like_the_group_outside_a_capture() -> None:
    world = FakeCPWorld(3)

    def body(group):  # noqa: ANN001, ANN202
        wrapped = EagerBreakCPGroup(group)
        wrapped.barrier()
        return wrapped.all_gather(torch.full((2,), float(group.rank)), tag="t/x")

    outs = run_ranks(world, body)
    want = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0])
    assert all(torch.equal(o, want) for o in outs)
