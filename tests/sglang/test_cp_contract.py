"""The sharding contract between SGLang's interleave CP and dsv4cp's, on SGLang's own helpers.

SGLang's `InterleaveCPStrategy` (sglang/srt/layers/cp/interleave.py) and dsv4cp's `CPLayout`
(dsv4cp/cp/layout.py) must put the same global tokens on the same rank in the same local order
(dsv4cp with `align = cp`, SGLang's physical padding), and gather back to the same order. With
that, and SGLang handing a dsv4cp-served model the full batch (`enable_cp_tp_group_sharing`,
test_server_args.py), the tokens of a batch are split exactly once, by dsv4cp.

`SGLangCP.group_for` must run CP on exactly the forwards SGLang counts as CP prefills
(`is_cp_active`): EXTEND or MIXED with at least cp new tokens.

SGLang's process-wide parallel context is replaced by a stand-in (rank, size); the all-gather by
a concatenation of every rank's shard. No process group is created.
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.cp.layout import CPLayout
from dsv4cp.integrations.sglang.cp import SGLangCP
from dsv4cp.integrations.sglang.server_args import CPSettings

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

CASES = [
    (cp, lens)
    for cp in (2, 3, 4, 8)
    for lens in ([1], [5], [8], [13], [3, 4, 9], [16, 1, 7, 2], [cp * 5])
]


@pytest.fixture
def sglang_cp(monkeypatch: pytest.MonkeyPatch):
    """SGLang's interleave strategy with the rank/size of a stand-in parallel context."""
    from sglang.srt.layers.cp import base, interleave, padding

    ctx = SimpleNamespace(attn_cp_rank=0, attn_cp_size=1, attn_cp_group=None)
    gathered: dict[str, torch.Tensor] = {}
    for mod in (base, padding):
        monkeypatch.setattr(mod, "get_parallel", lambda: ctx)
    monkeypatch.setattr(interleave, "get_parallel", lambda: ctx, raising=False)
    monkeypatch.setattr(interleave, "is_allocation_symmetric", lambda: False)
    monkeypatch.setattr(
        interleave, "use_symmetric_memory", lambda *a, **k: contextlib.nullcontext()
    )

    def all_gather(out: torch.Tensor, local: torch.Tensor) -> None:
        out.copy_(gathered["rank_major"])

    monkeypatch.setattr(interleave, "attn_cp_all_gather_into_tensor", all_gather)

    def make(cp: int) -> tuple[object, SimpleNamespace, dict]:
        ctx.attn_cp_size = cp
        strategy = interleave.InterleaveCPStrategy(cp_size=cp)
        monkeypatch.setattr(base, "_STRATEGY", strategy)
        return strategy, ctx, gathered

    return make


def _forward_batch(strategy: object, lens: list[int]) -> SimpleNamespace:
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    t = sum(lens)
    meta = strategy.build_metadata(num_tokens=t, seqs_len=lens, extend_seqs_len=lens)
    pad_logical_token_to_physical(meta)
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        attn_cp_metadata=meta,
        extend_seq_lens_cpu=lens,
        input_ids=torch.arange(t),
    )


@pytest.mark.parametrize(("cp", "lens"), CASES)
def test_same_tokens_on_the_same_rank_in_the_same_order(
    sglang_cp, cp: int, lens: list[int]
) -> None:
    strategy, ctx, _ = sglang_cp(cp)
    fb = _forward_batch(strategy, lens)
    t = sum(lens)
    layout = CPLayout.build(t, cp, align=cp)  # SGLang pads every rank to a multiple of cp
    x = torch.randn(t, 3)
    positions = torch.cat([torch.arange(n) + 100 * i for i, n in enumerate(lens)])
    for rank in range(cp):
        ctx.attn_cp_rank = rank
        assert torch.equal(strategy.shard_hidden_states(x, fb), layout.shard(x, rank))
        assert torch.equal(
            strategy.shard_position_ids(positions, fb), layout.shard(positions, rank)
        )
    assert fb.attn_cp_metadata.per_rank_logical_token == list(layout.logical_rows)
    assert fb.attn_cp_metadata.per_rank_actual_token == [layout.padded_rows] * cp


@pytest.mark.parametrize(("cp", "lens"), CASES)
def test_gather_restores_the_same_order(sglang_cp, cp: int, lens: list[int]) -> None:
    strategy, ctx, gathered = sglang_cp(cp)
    fb = _forward_batch(strategy, lens)
    t = sum(lens)
    layout = CPLayout.build(t, cp, align=cp)
    x = torch.randn(t, 4)
    gathered["rank_major"] = layout.rank_major(x)
    for rank in range(cp):
        ctx.attn_cp_rank = rank
        out = strategy.gather_hidden_states(layout.shard(x, rank), fb)
        assert torch.equal(out, x)
        assert torch.equal(out, layout.unshard(gathered["rank_major"]))


@pytest.mark.parametrize(("cp", "lens"), CASES)
def test_rows_per_request_agree(cp: int, lens: list[int]) -> None:
    from sglang.srt.layers.cp.interleave import interleave_rows_per_request

    layout = CPLayout.build(sum(lens), cp)
    ends = torch.tensor(lens).cumsum(0)
    for rank in range(cp):
        ids = layout.local_token_ids(rank)
        ids = ids[ids >= 0]
        mine = torch.bincount(torch.searchsorted(ends, ids, right=True), minlength=len(lens))
        assert mine.tolist() == interleave_rows_per_request(lens, rank, cp)


class _Group:
    def __init__(self, size: int) -> None:
        self.cp_size = size


@pytest.mark.parametrize(
    ("mode", "lens", "active"),
    [
        ("EXTEND", [3, 2], True),  # 5 new tokens >= cp 4
        ("EXTEND", [2, 1], False),  # 3 < 4: replicated on every rank
        ("MIXED", [4, 1, 1], True),
        ("DECODE", [1, 1, 1, 1, 1], False),
        ("IDLE", [], False),
    ],
)
def test_cp_runs_exactly_when_sglang_counts_a_cp_prefill(
    sglang_cp, mode: str, lens: list[int], active: bool
) -> None:
    from sglang.srt.layers.cp.utils import is_cp_active
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    sglang_cp(4)
    fb = SimpleNamespace(
        forward_mode=getattr(ForwardMode, mode),
        extend_seq_lens_cpu=lens,
        input_ids=torch.zeros(sum(lens), dtype=torch.long),
    )
    assert is_cp_active(fb) is active
    built: list[_Group] = []
    cp = SGLangCP(
        CPSettings(4, "interleave"), group_factory=lambda: built.append(_Group(4)) or built[-1]
    )
    group = cp.group_for(fb)
    assert (group is built[0]) if active else isinstance(group, SingleCPGroup)
    assert cp.group_for(fb) is group or not active  # built once, then reused
    assert len(built) == int(active)


def test_no_cp_settings_never_build_a_group() -> None:
    cp = SGLangCP(
        CPSettings(), group_factory=lambda: pytest.fail("built a group"), is_active=lambda fb: True
    )
    assert isinstance(cp.group_for(object()), SingleCPGroup)


def test_group_of_the_wrong_size_is_refused() -> None:
    cp = SGLangCP(
        CPSettings(4, "interleave"), group_factory=lambda: _Group(2), is_active=lambda fb: True
    )
    with pytest.raises(ValueError, match="2 ranks"):
        cp.group_for(object())
