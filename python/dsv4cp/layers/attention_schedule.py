"""The prepare DAG of `DeepseekV41Attention` (layers/attention.py), `build_schedule`: the layer's
prepare nodes, one method each, in the lanes, forks and joins of its role (the attention module's
docstring names the lanes), then the release of the buffers only the prepare reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dsv4cp.roles import LayerRole
from dsv4cp.schedule import DEFAULT, Fork, Join, Node, PrepareState, Release, Schedule, Step


class PrepareNodes(Protocol):
    """What the schedule reads of the layer (`DeepseekV41Attention`): its role and its prepare
    nodes."""

    role: LayerRole

    def _qkv_a(self, st: PrepareState) -> None: ...
    def _compressor_proj(self, st: PrepareState) -> None: ...
    def _q_norm(self, st: PrepareState) -> None: ...
    def _q_chain(self, st: PrepareState) -> None: ...
    def _indexer_qw(self, st: PrepareState) -> None: ...
    def _swa_rows(self, st: PrepareState) -> None: ...
    def _gather_kv(self, st: PrepareState) -> None: ...
    def _gather_comp(self, st: PrepareState) -> None: ...
    def _swa_store(self, st: PrepareState) -> None: ...
    def _compressor(self, st: PrepareState) -> None: ...
    def _logits_topk(self, st: PrepareState) -> None: ...


def build_schedule(attn: PrepareNodes, overlap_gathers: bool) -> Schedule:
    """`DeepseekV41Attention.schedule`'s build of one variant (`overlap_gathers`)."""
    role = attn.role

    def node(
        fn: Callable[[PrepareState], None],
        reads: tuple[str, ...],
        writes: tuple[str, ...],
        lane: str = DEFAULT,
        collective: bool = False,
    ) -> Node:  # a node is named after its method: `_q_chain` → "q_chain"
        return Node(fn.__name__.removeprefix("_"), fn, reads, writes, lane, collective)

    kv_src, idx = role.owns_compressor, role.index_source
    steps: list[Step] = [node(attn._qkv_a, ("x",), ("q_raw", "kv_raw"))]
    if kv_src:
        steps.append(node(attn._compressor_proj, ("x",), ("comp_kv",)))
    steps.append(node(attn._q_norm, ("q_raw",), ("q_lora",)))
    q_lanes: list[Step] = [Fork(("q", "indexer") if idx else ("q",), compute_only=True)]
    q_lanes.append(node(attn._q_chain, ("q_lora",), ("q",), lane="q"))
    if idx:
        q_lanes.append(node(attn._indexer_qw, ("q_lora", "x"), ("idx_q", "idx_w"), lane="indexer"))
    gathers: list[Step] = [
        node(attn._swa_rows, ("kv_raw",), ("swa_rows",)),
        node(attn._gather_kv, ("swa_rows",), ("swa_rows_g",), collective=True),
    ]
    if kv_src:
        gathers.append(node(attn._gather_comp, ("comp_kv",), ("comp_kv_g",), collective=True))
    steps += q_lanes + gathers if overlap_gathers else gathers + q_lanes
    side = ("swa", "compressor") if kv_src else ("swa",)
    steps.append(Fork(side))
    steps.append(node(attn._swa_store, ("swa_rows_g",), ("swa_cache",), lane="swa"))
    if kv_src:
        steps.append(
            node(
                attn._compressor,
                ("comp_kv_g",),
                ("comp_cache", "index_cache"),
                lane="compressor",
            )
        )
    steps.append(Join(("q", "indexer", *side) if idx else ("q", *side)))
    if idx:
        steps.append(node(attn._logits_topk, ("idx_q", "idx_w"), ("topk",)))
    released = ["q_raw", "kv_raw", "swa_rows", "swa_rows_g", "q_lora"]
    if kv_src:
        released += ["comp_kv", "comp_kv_g"]
    if idx:
        released += ["idx_q", "idx_w"]
    steps.append(Release(tuple(released)))
    outputs = ("q", "swa_cache") + (("topk",) if idx else ())
    name = f"layer{role.layer}:{role.name}" + ("" if overlap_gathers else ":gathers-first")
    return Schedule(name, tuple(steps), ("x",), outputs)
