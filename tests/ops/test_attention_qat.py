"""quant="qat" in the attention ops: where the fp8/fp4 steps and bf16 roundings sit, and the
reference's index-score and sparse-attention orders (DeepSeek-V4.1 `inference/model.py`,
`kernel_cpu.py`; docs/quantization.md). The quantizers themselves are tested bit-exact against the
reference in test_quant.py; here each qat op must equal its steps written out with them."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4cp.ops import (
    YarnScaling,
    compressed_key,
    index_key,
    mqa_logits,
    rope_index_queries,
    sparse_attention,
    sparse_attention_qat,
    store_swa_k,
    swa_key,
)
from dsv4cp.ops.attention_quant import (
    fake_quant_compressed_key_fp4,
    fake_quant_index_fp4,
    fake_quant_swa_key_fp8,
    quant_swa_key_fp8,
)
from dsv4cp.ops.norm import rms_norm
from dsv4cp.ops.rope import apply_rope

YARN = YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
THETA = 160000.0


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_swa_key_qat_rounds_after_norm_and_rope_then_fp8() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 64, generator=g) * 4).bfloat16()
    w = (torch.rand(64, generator=g) + 0.5).bfloat16()
    pos = torch.tensor([0, 1, 5, 17, 100, 999, 4096, 65535, 70000])
    got = swa_key(x, pos, w, 1e-6, 16, THETA, YARN, quant="qat")
    steps = fake_quant_swa_key_fp8(apply_rope(rms_norm(x, w, 1e-6), pos, 16, THETA, YARN))
    assert torch.equal(bits(got), bits(steps))
    codes, scale = quant_swa_key_fp8(got)  # already on the fp8 grid: quantizing is lossless
    assert torch.equal(codes.float() * scale.repeat_interleave(32, -1), got.float())
    none = swa_key(x, pos, w, 1e-6, 16, THETA, YARN)
    assert not torch.equal(got, none)
    assert (got.float() - none.float()).abs().max() <= 2.0**-4 * none.float().abs().max()
    cache = torch.zeros(20, 64, dtype=torch.bfloat16)
    slots = torch.randperm(20, generator=g)[:9]
    store_swa_k(x, pos, slots, cache, w, 1e-6, 16, THETA, YARN, "qat")
    assert torch.equal(bits(cache[slots]), bits(got))


def test_compressed_and_index_keys_quantize_after_rope() -> None:
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(6, 64, generator=g).bfloat16()
    pos = torch.arange(6) * 2
    got = compressed_key(lat, pos, 16, THETA, YARN, quant="qat")
    want = fake_quant_compressed_key_fp4(compressed_key(lat, pos, 16, THETA, YARN))
    assert torch.equal(bits(got), bits(want))
    wk, kn = (torch.randn(32, 64, generator=g) / 8).bfloat16(), torch.rand(32).bfloat16()
    got = index_key(lat, wk, kn, 1e-20, pos, 16, THETA, YARN, quant="qat")
    want = fake_quant_index_fp4(index_key(lat, wk, kn, 1e-20, pos, 16, THETA, YARN))
    assert torch.equal(bits(got), bits(want))


def test_index_queries_are_roped_per_head_then_fp4() -> None:
    g = torch.Generator().manual_seed(2)
    qp = torch.randn(5, 4 * 32, generator=g).bfloat16()
    pos = torch.tensor([0, 3, 8, 21, 50])
    got = rope_index_queries(qp, pos, 16, THETA, YARN, head_dim=32, quant="qat")
    heads = apply_rope(qp.view(5, 4, 32), pos, 16, THETA, YARN)
    assert torch.equal(bits(got), bits(fake_quant_index_fp4(heads)))
    with pytest.raises(ValueError, match="q_proj must be"):
        rope_index_queries(qp[:, :100], pos, 16, THETA, head_dim=32)


def _reference_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`Indexer.forward`'s expression in bf16 torch ops: einsum, relu, × weights, sum over heads."""
    s = torch.einsum("thd,nd->thn", q.bfloat16(), k.bfloat16())
    return (s.relu() * w.bfloat16()[..., None]).sum(dim=1).float()


def test_mqa_logits_qat_is_the_references_bf16_expression() -> None:
    g = torch.Generator().manual_seed(3)
    t, h, d, n = 12, 16, 32, 40
    q = fake_quant_index_fp4(torch.randn(t, h, d, generator=g).bfloat16())
    k = fake_quant_index_fp4(torch.randn(n, d, generator=g).bfloat16())
    w = torch.randn(t, h, generator=g) * (d**-0.5 * h**-0.5)
    nv = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 40, 40, 39, 3])
    got = mqa_logits(q, w, k, nv, quant="qat")
    want = _reference_scores(q, k, w)
    j = torch.arange(n)
    vis = j < nv[:, None]
    assert torch.equal(got[vis], want[vis])
    assert torch.all(got[~vis] == float("-inf"))
    assert torch.equal(got[vis], got[vis].bfloat16().float())  # bf16 values
    assert not torch.equal(got, mqa_logits(q, w, k, nv))


def _loop_sparse_attention(q, kv, idx, sink, scale, block=64):  # noqa: ANN001, ANN202
    """Per token and head: the online softmax over index blocks, p rounded to bf16 for p·v."""
    t, h, d = q.shape
    out = torch.zeros(t, h, d)
    for r in range(t):
        for hh in range(h):
            m, total, acc = -1e30, 0.0, torch.zeros(d, dtype=torch.float64)
            for a in range(0, idx.shape[1], block):
                ids = [int(i) for i in idx[r, a : a + block] if i >= 0]
                if not ids:
                    continue
                s = [float(q[r, hh].double() @ kv[i].double()) * scale for i in ids]
                m_new = max(m, *s)
                alpha = math.exp(m - m_new)
                p = [math.exp(v - m_new) for v in s]
                total = total * alpha + sum(p)
                pb = torch.tensor(p).bfloat16().double()
                acc = acc * alpha + sum(pb[j] * kv[i].double() for j, i in enumerate(ids))
                m = m_new
            if m > -1e30:  # a row with no valid index stays 0
                out[r, hh] = (acc / (total + math.exp(float(sink[hh]) - m))).float()
    return out.to(q.dtype)


def test_sparse_attention_qat_rounds_probabilities_per_block() -> None:
    g = torch.Generator().manual_seed(4)
    t, h, d, n = 5, 3, 32, 200
    q = (torch.randn(t, h, d, generator=g) * 2).bfloat16()
    kv = torch.randn(n, d, generator=g).bfloat16()
    idx = torch.randint(-1, n, (t, 150), generator=g, dtype=torch.int32)  # 3 blocks of 64
    idx[1] = -1  # nothing valid: 0
    idx[2, 64:] = -1
    sink = torch.randn(h, generator=g)
    got = sparse_attention_qat(q, kv, idx, sink, d**-0.5)
    want = _loop_sparse_attention(q, kv, idx, sink, d**-0.5)
    assert torch.all(got[1] == 0)
    # the loop sums in fp64: the same up to fp32 rounding, which rarely moves a bf16 output
    assert (got == want).float().mean() >= 0.99
    assert (got.float() - want.float()).abs().max() <= 2.0**-8 * want.float().abs().max()
    exact = sparse_attention(q, kv, idx, sink, d**-0.5)  # fp32 probabilities
    assert not torch.equal(got, exact)
    assert (got.float() - exact.float()).abs().max() <= 2.0**-6 * exact.float().abs().max()
