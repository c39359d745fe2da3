"""`rowwise_linear_fp32`: the fp32 GEMM of one row does not depend on the rows beside it (CP
shares, chunks), and equals the plain GEMM up to fp32 summation order."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.rowwise import CALL_TILES, ROW_TILE, rowwise_linear_fp32


@pytest.mark.parametrize("k,n", [(512, 24), (128, 8), (5120 // 8, 384 // 8)])
def test_rows_are_independent_of_their_neighbours(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(203, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    full = rowwise_linear_fp32(x, w)
    assert full.dtype == torch.float32 and full.shape == (203, n)
    ref = x.double() @ w.double().t()
    assert (full - ref).abs().max() <= 1e-5 * ref.abs().max()
    for m in (1, 3, 7, 16, ROW_TILE - 1, ROW_TILE + 1, 100):
        parts = torch.cat([rowwise_linear_fp32(x[a : a + m], w) for a in range(0, 203, m)])
        assert torch.equal(parts, full), m
    strided = rowwise_linear_fp32(x[1::2], w)  # the rows of one CP rank (interleaved split)
    assert torch.equal(strided, full[1::2])


def test_leading_dims_and_errors() -> None:
    x = torch.randn(3, 5, 32)
    w = torch.randn(4, 32)
    assert torch.equal(
        rowwise_linear_fp32(x, w), rowwise_linear_fp32(x.view(15, 32), w).view(3, 5, 4)
    )
    with pytest.raises(ValueError, match="rowwise_linear_fp32"):
        rowwise_linear_fp32(x, torch.randn(4, 31))


def test_every_call_is_one_gemm_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library picks its kernel by shape and batch count: every batched GEMM this op issues
    has the same shape, whatever the row count (1 row, a tile and one, several calls, none)."""
    shapes = set()
    bmm = torch.bmm

    def recording(a: torch.Tensor, b: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
        shapes.add((tuple(a.shape), tuple(b.shape)))
        return bmm(a, b, **kw)

    monkeypatch.setattr(torch, "bmm", recording)
    w = torch.randn(24, 96)
    for t in (1, ROW_TILE + 1, ROW_TILE * CALL_TILES * 3 + 5, 0):
        out = rowwise_linear_fp32(torch.randn(t, 96), w)
        assert out.shape == (t, 24)
    assert shapes == {((CALL_TILES, ROW_TILE, 96), (CALL_TILES, 96, 24))}
