"""GPU: the kernels that read quantized caches against their ops twins, at Flash dims.

- sparse_attention_cached, bf16 q, SWA fp8 + compressed fp4 rows, 128 window + 512 top-k keys:
  ‖kernel − twin‖ / ‖twin‖ < 1e-2 and max |Δ| < 2e-2 (bf16 output, p rounded to bf16 for p·v,
  as for the dense kernel in test_sparse_attention.py);
- the decoded values are exact in bf16, so a dense cache holding them gives the same kernel
  output bit for bit;
- mqa_logits_cached, fp4 keys and fake-fp4 queries (qat): equal to the twin but for rare one-ulp
  bf16 differences (≤ 1e-3 of the entries), fp32 ("none"): relative error < 1e-5 with dense keys.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops
from dsv4cp.kernels.attention import sparse_attention_cached
from dsv4cp.kernels.indexer_logits_cached import mqa_logits_cached
from dsv4cp.ops.attention_quant import fake_quant_index_fp4
from dsv4cp.ops.kv_format import decode_rows, encode_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _attention_inputs(t: int, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, 64, 512, device="cuda", generator=g).bfloat16()
    swa_v = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    comp_v = torch.randn(8192, 512, device="cuda", generator=g).bfloat16()
    win = torch.randint(-1, 4096, (t, 128), device="cuda", generator=g, dtype=torch.int32)
    top = torch.randint(-1, 8192, (t, 512), device="cuda", generator=g, dtype=torch.int32)
    sink = torch.randn(64, device="cuda", generator=g)
    return q, swa_v, comp_v, win, top, sink


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_attention_reads_quantized_caches(quant: str) -> None:
    q, swa_v, comp_v, win, top, sink = _attention_inputs(64, 0)
    swa = encode_rows(swa_v, "fp8_ue8m0_32", dense_dtype=torch.bfloat16)
    comp = encode_rows(comp_v, "fp4_e4m3_16", dense_dtype=torch.bfloat16)
    args = (q, swa, win, comp, top, sink, 512**-0.5, "fp8_ue8m0_32", "fp4_e4m3_16", quant)
    out = sparse_attention_cached(*args)
    ref = ops.sparse_attention_cached(*args)
    d = (out.float() - ref.float()).abs()
    assert d.max().item() < 2e-2
    assert (d.double().norm() / ref.double().norm()).item() < 1e-2
    # the same values stored dense: the kernel's output is bit-identical
    swa_d = decode_rows(swa, "fp8_ue8m0_32", 512).bfloat16()
    comp_d = decode_rows(comp, "fp4_e4m3_16", 512).bfloat16()
    dense = sparse_attention_cached(q, swa_d, win, comp_d, top, sink, 512**-0.5, quant=quant)
    assert torch.equal(dense, out)


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_the_portable_route_over_a_workspace_is_the_cached_kernel(
    quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither FlashMLA (not installed here) nor Gluon (off): the routed call decodes the rows
    into a workspace and runs the cached kernel's math over it — bit-identical to the kernel on
    the caches (the decode is exact, as the dense case above shows), in one call or in chunks,
    and under CUDA-graph replay."""
    from dsv4cp.kernels import attention_workspace, flashmla

    monkeypatch.setattr(flashmla, "_module", [None])
    monkeypatch.setattr(flashmla, "_said", set())
    monkeypatch.delenv(flashmla.ENV_FLAG, raising=False)
    monkeypatch.setenv(flashmla.GLUON_ENV, "off")
    q, swa_v, comp_v, win, top, sink = _attention_inputs(200, 1)
    swa = encode_rows(swa_v, "fp8_ue8m0_32", dense_dtype=torch.bfloat16)
    comp = encode_rows(comp_v, "fp4_e4m3_16", dense_dtype=torch.bfloat16)
    args = (q, swa, win, comp, top, sink, 512**-0.5, "fp8_ue8m0_32", "fp4_e4m3_16", quant)
    assert flashmla.sparse_attention_cached_backend(q).startswith(flashmla.TRITON_OVER_WORKSPACE)
    want = sparse_attention_cached(*args)
    assert torch.equal(flashmla.sparse_attention_cached(*args), want)
    no_comp = (q, swa, win, None, None, sink, 512**-0.5, "fp8_ue8m0_32", "dense", quant)
    assert torch.equal(
        flashmla.sparse_attention_cached(*no_comp), sparse_attention_cached(*no_comp)
    )
    graph = torch.cuda.CUDAGraph()
    flashmla.sparse_attention_cached(*args)  # warm: compiled before capture
    with torch.cuda.graph(graph):
        out = flashmla.sparse_attention_cached(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    # chunks of MIN_CHUNK_ROWS
    monkeypatch.setattr(attention_workspace, "WORKSPACE_BUDGET_BYTES", 1)
    monkeypatch.setattr(attention_workspace, "MIN_CHUNK_ROWS", 64)
    sources = attention_workspace.workspace_sources(*args[1:5], *args[7:9], None)
    assert len(attention_workspace.chunks(200, sources, 1024)) > 1
    assert torch.equal(flashmla.sparse_attention_cached(*args), want)


def test_index_logits_read_fp4_keys() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    t, h, d, n = 512, 32, 128, 20000
    q = fake_quant_index_fp4(torch.randn(t, h, d, device="cuda", generator=g).bfloat16())
    w = torch.randn(t, h, device="cuda", generator=g) / 64
    keys = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    cache = encode_rows(keys, "fp4_ue8m0_32", dense_dtype=torch.bfloat16)
    rows = torch.randperm(n, device="cuda", generator=g)[:16384]
    nv = torch.randint(0, 16284, (t,), device="cuda", generator=g)  # k_start + n ≤ N
    ks = torch.zeros(t, dtype=torch.long, device="cuda")
    ks[t // 2 + 3 :] = 100  # one block straddles two requests
    kw = dict(k_start=ks, width=16284, k_format="fp4_ue8m0_32", quant="qat")
    out = mqa_logits_cached(q, w, cache, rows, nv, **kw)
    ref = ops.mqa_logits_cached(q, w, cache, rows, nv, **kw)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    differ = (out[fin] != ref[fin]).float().mean().item()
    ulp = (ref[fin].abs() * 2.0**-7).clamp_min(1e-30)
    assert differ <= 1e-3 and ((out[fin] - ref[fin]).abs() <= ulp).all()
    dense = keys.float()
    q32, kw32 = q.float(), dict(k_start=ks, width=16284)
    out = mqa_logits_cached(q32, w, dense, rows, nv, **kw32)
    ref = ops.mqa_logits_cached(q32, w, dense, rows, nv, **kw32)
    fin = torch.isfinite(ref)
    rel = (out[fin] - ref[fin]).double().norm() / ref[fin].double().norm()
    assert rel.item() < 1e-5
