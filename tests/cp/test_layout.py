from __future__ import annotations

import pytest
import torch

from dsv4cp.cp.layout import CPLayout

TS = (1, 2, 3, 5, 31, 130)
CPS = (1, 2, 3, 4)


def _gather_all(layout: CPLayout, x: torch.Tensor, pad_value=0) -> torch.Tensor:
    return torch.cat([layout.shard(x, r, pad_value) for r in range(layout.cp_size)])


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("t", TS)
@pytest.mark.parametrize("align", (1, 4))
def test_round_trip(t: int, cp: int, align: int) -> None:
    lay = CPLayout.build(t, cp, align=align)
    x = torch.randn(t, 3, 2)
    g = _gather_all(lay, x, pad_value=float("nan"))
    assert g.shape == (cp * lay.padded_rows, 3, 2)
    torch.testing.assert_close(lay.unshard(g), x, rtol=0, atol=0)
    # counts
    assert sum(lay.logical_rows) == t
    assert lay.logical_rows == tuple(t // cp + (r < t % cp) for r in range(cp))
    assert lay.padded_rows >= max(lay.logical_rows) and lay.padded_rows % align == 0
    assert lay.padded_rows - max(lay.logical_rows) < align
    # local rows: token t at rank t % cp, row t // cp
    for r in range(cp):
        ids = lay.local_token_ids(r)
        mask = lay.local_mask(r)
        assert ids.dtype == torch.long and ids.shape == (lay.padded_rows,)
        assert mask.dtype == torch.bool and int(mask.sum()) == lay.logical_rows[r]
        assert torch.equal(ids >= 0, mask)
        assert ids[mask].tolist() == list(range(r, t, cp))
        assert (ids[~mask] == -1).all()
        assert lay.pad_rows(r) == lay.padded_rows - lay.logical_rows[r]
    # rerange index: row of token t in the rank-major buffer
    tok = torch.arange(t)
    assert torch.equal(lay.rerange_index, (tok % cp) * lay.padded_rows + tok // cp)
    assert torch.equal(lay.gathered_token_ids()[lay.rerange_index], tok)
    assert torch.equal(lay.rank_major(x), _gather_all(lay, x))


def test_worked_example_bcg_3_2() -> None:
    # cp-multistream-bcg.md §3.2: T=10 (requests of 6 and 4), cp=4, align=4 → P=4
    lay = CPLayout.build(10, 4, align=4)
    assert lay.logical_rows == (3, 3, 2, 2)
    assert lay.padded_rows == 4 and lay.gathered_rows == 16
    assert lay.local_token_ids(0).tolist() == [0, 4, 8, -1]
    assert lay.local_token_ids(1).tolist() == [1, 5, 9, -1]
    assert lay.local_token_ids(2).tolist() == [2, 6, -1, -1]
    assert lay.local_token_ids(3).tolist() == [3, 7, -1, -1]
    assert lay.gathered_token_ids().tolist() == [
        0,
        4,
        8,
        -1,
        1,
        5,
        9,
        -1,
        2,
        6,
        -1,
        -1,
        3,
        7,
        -1,
        -1,
    ]
    assert lay.rerange_index.tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6]
    x = torch.arange(10)
    assert lay.unshard(lay.rank_major(x, pad_value=-1)).tolist() == list(range(10))


def test_fewer_tokens_than_ranks() -> None:
    lay = CPLayout.build(2, 4)
    assert lay.logical_rows == (1, 1, 0, 0) and lay.padded_rows == 1
    assert lay.local_token_ids(3).tolist() == [-1]
    assert not lay.local_mask(2).any()
    x = torch.tensor([[1.0], [2.0]])
    assert lay.shard(x, 3, pad_value=7).tolist() == [[7.0]]
    assert lay.unshard(_gather_all(lay, x)).tolist() == [[1.0], [2.0]]


def test_dense_fast_path_is_transpose() -> None:
    lay = CPLayout.build(12, 3)
    assert lay.is_dense
    x = torch.randn(12, 5)
    g = _gather_all(lay, x)
    assert torch.equal(lay.unshard(g), g.view(3, 4, 5).transpose(0, 1).reshape(12, 5))
    assert torch.equal(lay.unshard(g), x)
    assert not CPLayout.build(11, 3).is_dense


def test_cp1_unshard_is_prefix() -> None:
    lay = CPLayout.build(5, 1, align=4)
    assert lay.padded_rows == 8
    x = torch.randn(5, 2)
    g = lay.shard(x, 0)
    assert g.shape == (8, 2) and torch.equal(g[5:], torch.zeros(3, 2))
    assert torch.equal(lay.unshard(g), x)


def test_shard_index_gathers_metadata() -> None:
    lay = CPLayout.build(7, 3)
    positions = torch.arange(100, 107)
    for r in range(3):
        idx = lay.shard_index(r, pad_index=0)
        assert idx.shape == (lay.padded_rows,)
        got = positions[idx]
        mask = lay.local_mask(r)
        assert torch.equal(got[mask], lay.shard(positions, r)[mask])
        assert (got[~mask] == positions[0]).all()
    assert lay.shard_index(2, pad_index=7).tolist() == [2, 5, 7]


def test_shard_keeps_dtype_and_is_contiguous() -> None:
    lay = CPLayout.build(9, 2)
    x = torch.randn(9, 4).to(torch.bfloat16)
    s = lay.shard(x, 1)
    assert s.dtype == torch.bfloat16 and s.is_contiguous() and s.shape == (5, 4)
    b = lay.shard(torch.ones(9, dtype=torch.bool), 1, pad_value=False)
    assert b.tolist() == [True, True, True, True, False]


def test_unshard_non_contiguous_input() -> None:
    lay = CPLayout.build(8, 2)
    x = torch.randn(8, 6)
    g = _gather_all(lay, x)
    wide = torch.cat([g, torch.zeros_like(g)], dim=1)[:, :6]  # strided view
    assert not wide.is_contiguous()
    assert torch.equal(lay.unshard(wide), x)


def test_to_device_and_equality() -> None:
    a = CPLayout.build(10, 4, align=4, device="cpu")
    assert a.to("cpu") is a
    assert a.rerange_index.device.type == "cpu"
    assert a == CPLayout.build(10, 4, align=4)
    assert hash(a) == hash(CPLayout.build(10, 4, align=4))
    assert a != CPLayout.build(10, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layout() -> None:
    lay = CPLayout.build(10, 4, align=4, device="cuda")
    assert lay.rerange_index.is_cuda and lay.local_token_ids(1).is_cuda
    x = torch.randn(10, 3, device="cuda")
    assert torch.equal(lay.unshard(lay.rank_major(x)), x)
    cpu = CPLayout.build(10, 4, align=4)
    assert torch.equal(cpu.unshard(cpu.rank_major(x)), x)  # index moved to the data


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_tokens": 0, "cp_size": 2}, ValueError, "num_tokens"),
        ({"num_tokens": -3, "cp_size": 2}, ValueError, "num_tokens"),
        ({"num_tokens": 4, "cp_size": 0}, ValueError, "cp"),
        ({"num_tokens": 4, "cp_size": -1}, ValueError, "cp"),
        ({"num_tokens": 4, "cp_size": 2, "align": 0}, ValueError, "align"),
        ({"num_tokens": 4.0, "cp_size": 2}, TypeError, "num_tokens"),
        ({"num_tokens": 4, "cp_size": True}, TypeError, "cp"),
    ],
)
def test_build_errors(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        CPLayout.build(**kwargs)


def test_bad_arguments() -> None:
    lay = CPLayout.build(5, 2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        lay.shard(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="rank -1 out of range"):
        lay.local_token_ids(-1)
    with pytest.raises(ValueError, match=r"expected 5 rows"):
        lay.shard(torch.zeros(4, 2), 0)
    with pytest.raises(ValueError, match=r"expected 6 rows"):
        lay.unshard(torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"expected 6 rows"):
        lay.unshard(torch.tensor(1.0))
    with pytest.raises(TypeError, match="Tensor"):
        lay.shard([1, 2, 3, 4, 5], 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("cp", (2, 4, 8))
def test_rank_major_dense_is_the_shards(cp: int) -> None:
    """A dense layout (T = cp·P) takes one transposing copy: the same rows as the shards, for a
    non-contiguous input too, and a wrong row count is refused as the shards refuse it."""
    lay = CPLayout.build(8 * cp, cp)
    assert lay.is_dense
    x = torch.randn(5, 8 * cp).t()  # [T, 5], not contiguous
    got = lay.rank_major(x)
    assert got.is_contiguous() and torch.equal(got, _gather_all(lay, x))
    assert torch.equal(lay.unshard(got), x)
    with pytest.raises(ValueError, match="rank_major"):
        lay.rank_major(torch.zeros(8 * cp + 1, 5))
