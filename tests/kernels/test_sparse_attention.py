"""GPU: the sparse-attention kernel against ops.attention.sparse_attention (fp32 softmax).

Tolerance: ‖kernel − ops‖ / ‖ops‖ < 1e-2 and max |kernel − ops| < 2e-2 (bf16 output, and the
probabilities are rounded to bf16 before the p·v product as in FlashMLA); exact zeros for rows
with no valid index.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops, routing
from dsv4cp.kernels.attention import launch_sparse_attention, sparse_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _compare(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    d = (out.float() - ref.float()).abs()
    assert d.max().item() < 2e-2
    rel = (d.double().norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert rel < 1e-2


def _inputs(t, h, d, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    sink = torch.randn(h, device="cuda", generator=g)
    return q, kv, sink, g


def _v41_indices(t: int, n: int, topk: int, window: int, g: torch.Generator) -> torch.Tensor:
    """[topk part | window part] per row, with -1 where the row has fewer entries (early rows)."""
    p = torch.arange(t, device="cuda") * (n // max(t, 1))
    top = torch.randint(0, n, (t, topk), device="cuda", generator=g, dtype=torch.int32)
    top = torch.where(torch.arange(topk, device="cuda")[None, :] <= p[:, None], top, -1)
    win = p[:, None] - torch.arange(window, device="cuda")[None, :]
    win = torch.where(win >= 0, win, -1).to(torch.int32)
    return torch.cat([top, win], 1)


def test_real_dims_v41_rows() -> None:
    q, kv, sink, g = _inputs(96, 64, 512, 8192, seed=0)
    idx = _v41_indices(96, 8192, 512, 128, g)
    scale = 512**-0.5
    want = ops.sparse_attention(q, kv, idx, sink, scale)
    _compare(sparse_attention(q, kv, idx, sink, scale), want)


@pytest.mark.parametrize(
    ("t", "h", "d", "n", "k"),
    [
        (1, 64, 512, 100, 640),
        (37, 64, 512, 999, 17),
        (13, 4, 96, 50, 40),
        (5, 128, 512, 300, 130),
        (9, 64, 512, 50, 1),
    ],  # K = 1: the launch pads it (no_count_of_one)
)
def test_odd_shapes(t: int, h: int, d: int, n: int, k: int) -> None:
    q, kv, sink, g = _inputs(t, h, d, n, seed=t + k)
    idx = torch.randint(-1, n, (t, k), device="cuda", generator=g, dtype=torch.int32)
    scale = d**-0.5
    want = ops.sparse_attention(q, kv, idx, sink, scale)
    _compare(sparse_attention(q, kv, idx, sink, scale), want)


def test_all_invalid_but_the_window() -> None:
    t, h, d, n, k = 8, 64, 512, 64, 640
    q, kv, sink, _ = _inputs(t, h, d, n, seed=7)
    idx = torch.full((t, k), -1, device="cuda", dtype=torch.int32)
    idx[:, 512] = torch.arange(t, device="cuda", dtype=torch.int32)  # the query itself
    idx[3] = -1  # no valid index at all: output 0
    out = sparse_attention(q, kv, idx, sink, d**-0.5)
    _compare(out, ops.sparse_attention(q, kv, idx, sink, d**-0.5))
    assert torch.all(out[3] == 0)


@pytest.mark.parametrize("config", [(32, 8, 2), (64, 8, 3)])
def test_config_variants(config: tuple) -> None:
    q, kv, sink, g = _inputs(33, 64, 512, 2000, seed=9)
    q[:5] *= 8  # large logits: the running max moves mid-row
    idx = torch.randint(-1, 2000, (33, 300), device="cuda", generator=g, dtype=torch.int32)
    want = ops.sparse_attention(q, kv, idx, sink, 512**-0.5)
    _compare(launch_sparse_attention(q, kv, idx, sink, 512**-0.5, config=config), want)


def test_unsupported_head_dim_raises() -> None:
    q, kv, sink, _ = _inputs(2, 4, 1024, 8, seed=8)
    idx = torch.zeros(2, 4, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="D must be in"):
        routing.sparse_attention(q, kv, idx, sink, 0.1)
