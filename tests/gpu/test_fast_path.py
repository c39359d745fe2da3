"""The layer's fast path on the GPU at V4.1-Flash dims (issue 15): FlashMLA's sparse prefill over
the chunk-bounded bf16 workspace, and the fused index logits + top-k over the index cache.

- the workspace built on the GPU holds the decoded rows bit for bit, indices remapped;
- FlashMLA over it against the ops twin (fp32 math over the same decoded keys): `none` and `qat`
  within the stated tolerance (max |diff| ≤ 2e-2, relative L2 ≤ 1e-2: FlashMLA's bf16 p·v and
  exp2 order), and against the Triton cached kernel; chunked calls equal one call bit for bit;
- the fused `mqa_topk_cached` equals the unfused GPU path (the cached-logits kernel + the
  selection) bit for bit for the full top-k (on both of its routes: the scan, and the logits
  to memory then the selection kernel) and the candidate source, both numerics (a consumer
  at this width takes the gather kernel, whose head sum is a tree: ≥ 99 % of rows), and the ops
  twin (fp64 dots) but for ties at the cut;
- one Flash-dims layer stack (roles 0, 2, 3 of Flash) forward on the fast path against the
  Triton cached kernel (`DSV4CP_FLASHMLA=off`): outputs close, top-k identical.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops, routing
from dsv4cp.kernels import attention_workspace, flashmla, indexer_topk
from dsv4cp.kernels import indexer_topk_cached as fused
from dsv4cp.ops.attention_quant import fake_quant_index_fp4
from dsv4cp.ops.kv_format import decode_rows, encode_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8, FP4, IDX = "fp8_ue8m0_32", "fp4_e4m3_16", "fp4_ue8m0_32"


def _needs_flashmla() -> None:
    pytest.importorskip("flash_mla")
    q = torch.zeros(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    backend = flashmla.sparse_attention_cached_backend(q)
    if not backend.startswith("FlashMLA"):
        pytest.skip(backend)


def _attention_inputs(t: int = 384, n_swa: int = 4096, n_comp: int = 2048, seed: int = 0):
    """Windows of consecutive rows (as a chunk's queries have), top-512 of the entries, some
    -1 pads and a row with no key; caches in the qat formats."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(t, 64, 512, device=dev, generator=g).bfloat16()
    swa = encode_rows(torch.randn(n_swa, 512, device=dev, generator=g), FP8, dense_dtype=q.dtype)
    comp = encode_rows(torch.randn(n_comp, 512, device=dev, generator=g), FP4, dense_dtype=q.dtype)
    pos = 1000 + torch.arange(t, device=dev)
    win = pos[:, None] - 127 + torch.arange(128, device=dev)[None, :]
    scores = torch.rand(t, n_comp, device=dev, generator=g)
    top = scores.topk(512, dim=1).indices.sort(dim=1).values
    top[:, 400:] = torch.where(torch.arange(t, device=dev)[:, None] % 3 == 0, -1, top[:, 400:])
    win[1], top[1] = -1, -1
    sink = torch.randn(64, device=dev, generator=g)
    return q, swa, win, comp, top, sink


def test_workspace_on_the_gpu_is_exact() -> None:
    q, swa, win, comp, top, sink = _attention_inputs()
    sources = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None)
    kv, idx = attention_workspace.build_workspace(
        sources, slice(0, q.shape[0]), 512, torch.bfloat16
    )
    keys = torch.cat([decode_rows(swa, FP8, 512), decode_rows(comp, FP4, 512)])
    both = torch.cat([win, torch.where(top >= 0, top + swa.shape[0], -1)], 1)
    v = both >= 0
    assert torch.equal(idx >= 0, v)
    assert torch.equal(kv[idx[v].long()].float(), keys[both[v]])
    w = win.shape[1]  # each source's rows are numbered 0…n−1 in row order after its offset
    for part, named in ((idx[:, :w], win), (idx[:, w:], top)):
        got = part[part >= 0].unique()
        n = int(named[named >= 0].unique().numel())
        assert got.numel() == n and int(got[-1] - got[0]) == n - 1


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_flashmla_over_the_workspace_matches_the_twin(quant: str) -> None:
    _needs_flashmla()
    q, swa, win, comp, top, sink = _attention_inputs(seed=1)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, quant)
    out = flashmla.sparse_attention_cached(*args)
    want = ops.sparse_attention_cached(*args)
    tri = flashmla.triton_attention.sparse_attention_cached(*args)
    assert torch.all(out[1] == 0), "a row with no key gives 0"
    for ref in (want, tri):
        diff = (out.float() - ref.float()).abs()
        assert diff.max() < 2e-2 and diff.norm() / ref.float().norm() < 1e-2, quant
    hint = (int(win[win >= 0].unique().numel()), int(top[top >= 0].unique().numel()))
    tight = flashmla.sparse_attention_cached(*args, workspace_rows=hint)
    assert torch.equal(tight, out), "the bound sizes the workspace, not the result"
    saved = attention_workspace.WORKSPACE_BUDGET_BYTES
    try:  # several chunks: each query row's result does not depend on its chunk
        attention_workspace.WORKSPACE_BUDGET_BYTES = 2 << 20  # chunks of 48 rows
        assert torch.equal(flashmla.sparse_attention_cached(*args), out)
    finally:
        attention_workspace.WORKSPACE_BUDGET_BYTES = saved


def _index_inputs(t: int, n: int, seed: int, qat: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, 32, 128, device="cuda", generator=g)
    w = torch.randn(t, 32, device="cuda", generator=g) * 128**-0.5 * 32**-0.5
    k = torch.randn(n, 128, device="cuda", generator=g)
    if qat:
        q = fake_quant_index_fp4(q.bfloat16())
        cache, fmt = encode_rows(k, IDX, dense_dtype=torch.bfloat16), IDX
    else:
        q, cache, fmt = q.bfloat16(), k.bfloat16(), "dense"
    rows = torch.randperm(n, device="cuda", generator=g)
    nv = torch.clamp((torch.arange(t, device="cuda") * n) // t + 1, max=n)
    return q, w, cache, rows, nv, fmt


@pytest.mark.parametrize("quant", ["none", "qat"])
@pytest.mark.parametrize("role", ["full", "full-logits", "source", "consumer"])
def test_fused_cached_topk_equals_the_unfused_gpu_path(
    quant: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t, n, k_top, bs = 512, 6000, 512, 8
    # "full" scans; "full-logits" takes the plain top-k's logits route (`pick_route` by width,
    # which reads the limit in indexer_topk, the launcher's module)
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_MAX_WIDTH", n if role == "full-logits" else 0)
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_KEYS_PER_ROW", 0)  # width alone decides
    role = role.removesuffix("-logits")
    q, w, cache, rows, nv, fmt = _index_inputs(t, n, 3, quant == "qat")
    logits = routing.kernel_of("mqa_logits_cached")(
        q, w, cache, rows, nv, width=n, k_format=fmt, quant=quant
    )
    kw = dict(width=n, k_format=fmt, quant=quant, block_size=bs)
    if role == "consumer":
        ids = ops.candidate_blocks(logits, nv, bs, 64).flip(1)  # unsorted ids
        got, _ = fused.mqa_topk_cached(q, w, cache, rows, nv, k_top, block_ids=ids, **kw)
        want = ops.topk_among_blocks(logits, nv, ids, bs, k_top)
    else:
        blocks_n = 64 if role == "source" else 0
        got, blocks = fused.mqa_topk_cached(q, w, cache, rows, nv, k_top, max_blocks=blocks_n, **kw)
        want = routing.kernel_of("topk_indices")(logits, nv, k_top)
        if role == "source":
            assert blocks is not None
            assert torch.equal(blocks, ops.candidate_blocks(logits, nv, bs, 64))
    if role == "consumer":  # the gather kernel adds the heads as a tree: ties may move
        same = (got == want).all(1).float().mean().item()
        assert same >= 0.99, same
    else:
        assert torch.equal(got, want), f"{(got != want).any(1).sum().item()} rows differ"
    # the ops twin (fp64 dots): identical but where a score ties at the cut
    twin, _ = ops.mqa_topk_cached(q, w, cache, rows, nv, k_top, max_blocks=0, **kw)
    if role != "consumer":
        same = (twin == got).all(1).float().mean().item()
        assert same >= 0.99, same


@pytest.mark.parametrize("route", ["scan", "logits"])
def test_layer_stack_fast_path_against_triton(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """Flash layers 0 (SWA), 2 (ratio-2 kv + index source), 3 (top-k reuse) in qat over a 1K
    prefix + 1K new tokens: the fast path against the Triton cached kernel, with the index
    source's top-k on either route (its 1K keys would take the logits route)."""
    _needs_flashmla()
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_MAX_WIDTH", 0 if route == "scan" else 8192)
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_KEYS_PER_ROW", 0)  # width alone decides
    from benchmarks.layer_peer_setup import build_layers, make_context

    from dsv4cp.config import DeepseekV41Config

    cfg = DeepseekV41Config.flash()
    layers = build_layers(cfg, (0, 2, 3), torch.bfloat16, "cuda", quant="qat")
    x = torch.randn(1024, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5

    def run(flashmla_env: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        monkeypatch.setenv(flashmla.ENV_FLAG, flashmla_env)
        ctx = make_context(cfg, 1024, 1024, "cuda", torch.bfloat16, "qat")
        outs = [layers[i].forward(x, ctx) for i in (0, 2, 3)]
        return outs, ctx.cross.topk[2].clone()

    fast, topk_fast = run("auto")
    slow, topk_slow = run("off")
    assert torch.equal(topk_fast, topk_slow)
    for a, b in zip(fast, slow):
        assert torch.isfinite(a).all()
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 5e-2, rel.item()  # qat: fp8 activation steps amplify ~1e-3 differences


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_kernel_matches_the_op(inverse: bool) -> None:
    """The routed in-place RoPE of the q tail / the output's inverse at Flash dims, long-context
    positions: within one bf16 ulp of the op (cos/sin of the fp64-reduced angle), the head of
    each row untouched."""
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.kernels.rope import rope_tail_

    cfg = DeepseekV41Config.flash()
    theta, yarn = cfg.compress_rope(4)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4096, 64, 512, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, 1 << 20, (4096,), device="cuda", generator=g)
    want = ops.rope_tail_(x.clone(), pos, 64, theta, yarn, inverse)
    got = rope_tail_(x.clone(), pos, 64, theta, yarn, inverse)
    assert torch.equal(got[..., :448], x[..., :448])
    diff = (got.float() - want.float()).abs()
    assert (diff <= 2**-7 * want.float().abs().clamp_min(1.0)).all(), diff.max().item()
    assert (diff > 0).float().mean().item() < 0.01  # rare 1-ulp differences only


def test_flashmla_workspace_path_replays_in_a_cuda_graph() -> None:
    """No host sync in the workspace build: the call captures, and a replay over new cache
    contents equals the eager call on them."""
    _needs_flashmla()
    q, swa, win, comp, top, sink = _attention_inputs(seed=7)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, "qat")
    flashmla.sparse_attention_cached(*args)  # warm-up (lazy state, allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashmla.sparse_attention_cached(*args)
    fresh = encode_rows(torch.randn(swa.shape[0], 512, device="cuda"), FP8, dense_dtype=q.dtype)
    swa.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, flashmla.sparse_attention_cached(*args))


def test_fused_cached_topk_replays_in_a_cuda_graph() -> None:
    q, w, cache, rows, nv, fmt = _index_inputs(256, 3000, 9, True)
    kw = dict(width=3000, k_format=fmt, quant="qat", block_size=8, max_blocks=64)
    fused.mqa_topk_cached(q, w, cache, rows, nv, 512, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top, blocks = fused.mqa_topk_cached(q, w, cache, rows, nv, 512, **kw)
    cache.copy_(encode_rows(torch.randn(3000, 128, device="cuda"), IDX, dense_dtype=q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    want, want_blocks = fused.mqa_topk_cached(q, w, cache, rows, nv, 512, **kw)
    assert torch.equal(top, want) and blocks is not None and torch.equal(blocks, want_blocks)
