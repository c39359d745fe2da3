"""`CPGroup.all_to_all` (expert parallelism's exchange, docs/ep.md) on every backend: rows land
on the right rank in source-rank order, uneven and empty splits included, every dtype the MoE
sends; the split matrix from `split_matrix`; the order guard catches ranks that disagree on it.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.cp.fake import FakeCPWorld, run_ranks
from dsv4cp.cp.group import CPGroup, SingleCPGroup, split_matrix
from dsv4cp.cp.guard import CollectiveRecord, CPOrderError, splits_crc
from dsv4cp.cp.launch import CPLaunchError, spawn_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8)


def _counts(src: int, n: int) -> list[int]:
    """Rows rank `src` sends to each rank: uneven, some zero."""
    return [(3 * src + 2 * dst + 1) % 4 for dst in range(n)]


def _rows(src: int, n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rank `src`'s send buffer: row i of the block for dst holds 100·src + 10·dst + i."""
    parts = []
    for dst, c in enumerate(_counts(src, n)):
        vals = torch.tensor([100 * src + 10 * dst + i for i in range(c)], dtype=torch.float32)
        parts.append(vals.view(-1, 1).expand(-1, 5) % 200)  # fp8-representable small ints
    return torch.cat(parts).to(device=device).to(dtype)


def exchange_rank(group: CPGroup, device: str = "cpu") -> dict:
    """Every dtype: send counts → split matrix → all_to_all, checked against what each source
    sent (every rank can rebuild every other rank's buffer)."""
    n, me = group.cp_size, group.rank
    errors = []
    for dtype in DTYPES:
        x = _rows(me, n, dtype, device)
        counts = torch.tensor(_counts(me, n), device=device)
        splits = split_matrix(group, counts, tag=f"test/{dtype}/counts")
        assert splits == [_counts(i, n) for i in range(n)]
        got = group.all_to_all(x, splits, tag=f"test/{dtype}/rows")
        want = []
        for src in range(n):
            rows = _rows(src, n, dtype, device)
            start = sum(_counts(src, n)[:me])
            want.append(rows[start : start + _counts(src, n)[me]])
        expect = torch.cat(want)
        if (
            got.dtype != dtype
            or got.device.type != device
            or not torch.equal(got.view(torch.uint8).cpu(), expect.view(torch.uint8).cpu())
        ):
            errors.append(str(dtype))
    return {"ok": not errors, "failed": errors}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fake_all_to_all(n: int) -> None:
    for got in run_ranks(FakeCPWorld(n), exchange_rank):
        assert got["ok"], got


def test_gloo_all_to_all() -> None:
    for got in spawn_ranks(3, exchange_rank, backend="gloo", check_order=True):
        assert got["ok"], got


def test_single_group_all_to_all_is_identity() -> None:
    x = torch.randn(4, 3)
    g = SingleCPGroup()
    assert split_matrix(g, torch.tensor([4]), tag="t") == [[4]]
    assert g.all_to_all(x, [[4]], tag="t") is x
    with pytest.raises(ValueError, match="sends 3 rows"):
        g.all_to_all(x, [[3]], tag="t")


def _disagree(group: CPGroup) -> None:
    x = torch.zeros(2, 3)
    splits = [[1, 1], [1, 1]] if group.rank == 0 else [[2, 0], [0, 2]]
    group.all_to_all(x, splits, tag="layer0/ep_dispatch")


def test_fake_guard_catches_different_split_matrices() -> None:
    with pytest.raises(CPOrderError, match="splits") as info:
        run_ranks(FakeCPWorld(2), _disagree)
    assert "split matrix" in str(info.value)


def test_gloo_guard_catches_different_split_matrices() -> None:
    with pytest.raises(CPLaunchError) as info:
        spawn_ranks(2, _disagree, backend="gloo", check_order=True, timeout_s=30)
    assert isinstance(info.value.__cause__, CPOrderError), info.value
    assert "splits" in str(info.value.__cause__)


def test_bad_split_matrix_is_a_clear_error() -> None:
    world = FakeCPWorld(2)
    with pytest.raises(ValueError, match=r"\[2\]\[2\]"):
        world.groups[0].all_to_all(torch.zeros(2, 1), [[1, 1]], tag="t")
    with pytest.raises(ValueError, match="negative"):
        world.groups[0].all_to_all(torch.zeros(0, 1), [[1, -1], [0, 0]], tag="t")


def test_record_round_trip_keeps_the_split_crc() -> None:
    crc = splits_crc([[1, 2], [3, 4]])
    rec = CollectiveRecord.of(5, "all_to_all", "layer2/ep_combine", torch.zeros(3, 8), splits=crc)
    back = CollectiveRecord.decode(rec.encode())
    assert back == rec and back.splits == crc != splits_crc([[1, 2], [4, 3]])
    assert "splits#" in back.describe()
