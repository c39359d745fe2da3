"""kernels/flashmla over the quantized caches (its workspace: kernels/attention_workspace), on
the CPU with a fake `flash_mla`.

`sparse_attention_cached` on CUDA sends a query FlashMLA takes (H 64 / 128, D 512, bf16) to its
sparse prefill over a bf16 workspace: the cache rows the chunk's indices name, each decoded once,
the indices remapped into it. Here the fake FlashMLA computes the ops' dense attention over what
it is given, so the tests check the workspace and the remap exactly (the same keys in the same
order as `ops.sparse_attention_cached` reads), the chunking under a small budget, the static
bounds (never below the distinct rows, for the layer's batches too), and that the choice of
backend is said once. The interpreter covers the Triton decode (`test_fast_path_interpreter.py`);
the real wheel runs in `tests/gpu/test_fast_path.py`.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from dsv4cp import ops
from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import CrossLayer, ForwardContext
from dsv4cp.cp.fake import FakeCPWorld
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.kernels import attention as triton_attention
from dsv4cp.kernels import attention_workspace, flashmla
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.ops.kv_format import decode_rows, encode_rows
from dsv4cp.ops.workspace_rows import WorkspaceMemo
from tests.kernels.test_flashmla_dispatch import FakeFlashMLA

FP8, FP4 = "fp8_ue8m0_32", "fp4_e4m3_16"


class QatFakeFlashMLA(FakeFlashMLA):
    """The fake with the reference's attention order (blocks of 64, bf16 p for p·v)."""

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, **kw):  # type: ignore[no-untyped-def]
        self.calls.append(dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, **kw))
        out = ops.sparse_attention_qat(q, kv[:, 0], indices[:, 0], kw["attn_sink"], sm_scale)
        return out, None, None


def _install(monkeypatch: pytest.MonkeyPatch, mod: FakeFlashMLA) -> FakeFlashMLA:
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    monkeypatch.setattr(flashmla, "_module", [])
    monkeypatch.setattr(flashmla, "_said", set())
    monkeypatch.setattr(flashmla, "_capability", lambda x: (9, 0))
    monkeypatch.delenv(flashmla.ENV_FLAG, raising=False)
    return mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashMLA:
    return _install(monkeypatch, FakeFlashMLA())


def _caches(t: int = 6, h: int = 64, d: int = 512, seed: int = 0):
    """q bf16, an fp8 SWA pool and an fp4 compressed pool with window / top-k indices that
    repeat rows across queries (as a chunk's windows do), -1 pads, and a row with no key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    swa = encode_rows(torch.randn(90, d, generator=g), FP8, dense_dtype=torch.bfloat16)
    comp = encode_rows(torch.randn(70, d, generator=g) * 0.5, FP4, dense_dtype=torch.bfloat16)
    win = torch.randint(-1, 90, (t, 16), generator=g)
    win[:, :4] = torch.arange(4)  # shared by every query
    top = torch.randint(-1, 70, (t, 40), generator=g)
    top[1] = -1
    win[1] = -1  # no key at all: 0, as a padding row
    sink = torch.randn(h, generator=g)
    return q, swa, win, comp, top, sink


def _distinct(idx: torch.Tensor) -> int:
    return int(idx[idx >= 0].unique().numel())


def test_workspace_holds_each_named_row_once_decoded_exactly() -> None:
    q, swa, win, comp, top, sink = _caches()
    sources = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None)
    kv, idx = attention_workspace.build_workspace(
        sources, slice(0, q.shape[0]), 512, torch.bfloat16
    )
    assert kv.dtype == torch.bfloat16 and idx.dtype == torch.int32
    assert idx.shape == (q.shape[0], win.shape[1] + top.shape[1])
    w = win.shape[1]
    assert torch.equal(idx[:, :w] >= 0, win >= 0) and torch.equal(idx[:, w:] >= 0, top >= 0)
    # every valid index reads its row's decoded key, bit for bit (exact in bf16)
    want_swa = decode_rows(swa, FP8, 512)
    want_comp = decode_rows(comp, FP4, 512)
    v = win >= 0
    assert torch.equal(kv[idx[:, :w][v].long()].float(), want_swa[win[v]])
    v = top >= 0
    assert torch.equal(kv[idx[:, w:][v].long()].float(), want_comp[top[v]])
    # one workspace row per distinct cache row, in row order, the SWA rows first
    assert _distinct(idx[:, :w]) == _distinct(win) and _distinct(idx[:, w:]) == _distinct(top)
    assert int(idx[:, :w].max()) == _distinct(win) - 1
    bound = attention_workspace.chunk_bound(sources, q.shape[0])
    assert kv.shape[0] == bound == 90 + 70  # min(T·K, rows) per source


def test_tight_bound_and_no_compressed_source() -> None:
    q, swa, win, comp, top, sink = _caches(seed=1)
    hint = (_distinct(win), _distinct(top))  # the exact counts are a valid bound
    sources = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, hint)
    kv, idx = attention_workspace.build_workspace(
        sources, slice(0, q.shape[0]), 512, torch.bfloat16
    )
    assert kv.shape[0] == sum(hint) and int(idx.max()) == sum(hint) - 1
    sources = attention_workspace.workspace_sources(swa, win, None, None, FP8, FP4, (hint[0], 0))
    kv, idx = attention_workspace.build_workspace(
        sources, slice(0, q.shape[0]), 512, torch.bfloat16
    )
    assert idx.shape == win.shape and kv.shape[0] == hint[0]


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_flashmla_over_the_workspace_equals_the_cached_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, quant: str
) -> None:
    mod = _install(monkeypatch, QatFakeFlashMLA() if quant == "qat" else FakeFlashMLA())
    caplog.set_level(logging.INFO, logger="dsv4cp.kernels")
    q, swa, win, comp, top, sink = _caches(seed=2)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, quant)
    want = ops.sparse_attention_cached(*args)
    # 1 byte: chunks of MIN_CHUNK_ROWS
    for budget in (attention_workspace.WORKSPACE_BUDGET_BYTES, 1):
        monkeypatch.setattr(attention_workspace, "WORKSPACE_BUDGET_BYTES", budget)
        monkeypatch.setattr(attention_workspace, "MIN_CHUNK_ROWS", 2)
        out = flashmla.sparse_attention_cached(*args)
        assert out.dtype == torch.bfloat16 and torch.all(out[1] == 0)
        # the same keys in the same order; the -1 pad to 64 changes only the sums' grouping
        assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2), budget
        diff = (out.float() - want.float()).abs()
        assert diff.max() <= 2**-7 * want.float().abs().max()
    assert len(mod.calls) == 1 + 3  # one call, then three chunks of 2 rows
    call = mod.calls[0]
    assert call["kv"].shape[1:] == (1, 512) and call["indices"].shape == (6, 1, 64)
    assert call["use_legacy"] is True and call["d_v"] == 512
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "sparse attention: FlashMLA sparse prefill over a bf16 workspace (sgl-flash-mla 1.0.0)"
    ]


@pytest.mark.parametrize("chunked", [False, True])
def test_misfits_go_to_the_triton_kernel_over_a_workspace_said_once(
    fake: FakeFlashMLA,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    chunked: bool,
) -> None:
    """Neither FlashMLA nor Gluon takes H = 4: the Triton cached kernel's math runs over the
    workspace (two dense sources, window then top-k, so qat's blocks are unchanged) in the
    model dtype; `DSV4CP_FLASHMLA=off` keeps the kernel on the caches themselves."""
    calls: list[tuple] = []

    def fake_triton(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append((a[7], a[8], a[9], a[1].dtype, a[2].shape[1], a[4] is None or a[4].shape[1]))
        return ops.sparse_attention_cached(*a, **kw)

    monkeypatch.setattr(triton_attention, "sparse_attention_cached", fake_triton)
    if chunked:
        monkeypatch.setattr(attention_workspace, "WORKSPACE_BUDGET_BYTES", 1)
        monkeypatch.setattr(attention_workspace, "MIN_CHUNK_ROWS", 2)
    caplog.set_level(logging.INFO, logger="dsv4cp.kernels")
    q, swa, win, comp, top, sink = _caches(h=4, seed=3)
    for quant in ("qat", "none"):
        args = (q, swa, win, comp, top, sink, 0.1, FP8, FP4, quant)
        out = flashmla.sparse_attention_cached(*args)
        # the fake kernel is the ops twin: over the exactly decoded rows it is the twin's result
        assert torch.equal(out, ops.sparse_attention_cached(*args)), quant
    n = 3 if chunked else 1
    # qat: the workspace's [window | top-k] as one list (the same 64-key blocks); none: two
    assert (
        calls
        == [("dense", "dense", "qat", q.dtype, 56, True)] * n
        + [("dense", "dense", "none", q.dtype, 16, 40)] * n
    )
    assert not fake.calls
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("sparse attention: Triton kernel over a workspace (FlashMLA: ")
    assert "H=4" in line and "Gluon: " in line
    monkeypatch.setenv(flashmla.ENV_FLAG, "off")
    assert flashmla.sparse_attention_cached_backend(q) == (
        "Triton cached kernel (DSV4CP_FLASHMLA=off)"
    )
    calls.clear()
    flashmla.sparse_attention_cached(q, swa, win, comp, top, sink, 0.1, FP8, FP4, "qat")
    assert calls == [(FP8, FP4, "qat", swa.dtype, 16, 40)]
    with pytest.raises(ValueError, match="sink must be"):
        flashmla.sparse_attention_cached(q, swa, win, comp, top, sink[:2], 0.1, FP8, FP4)


# ------------------------------------------------------------------ the layer's bounds


def _context(
    cfg: DeepseekV41Config,
    requests: list[tuple[int, int]],
    cp: int = 1,
    rank: int = 0,
    quant: str = "none",
) -> ForwardContext:
    """Requests (prefix, new tokens) in one batch; slots dense per request; prefix keys 0."""
    total = sum(p + n for p, n in requests)
    context = max(p + n for p, n in requests) + 4
    cache = KVCache(cfg, total + 8, quant=quant, max_requests=len(requests),  # type: ignore[arg-type]
                    max_context=context, dtype=torch.bfloat16)  # fmt: skip
    slices, slots, base = [], [], 1
    for i, (p, n) in enumerate(requests):
        cache.req_to_token[i, : p + n] = torch.arange(base, base + p + n)
        slices.append(RequestSlice(f"r{i}", i, p, tuple(range(n))))
        slots += list(range(base + p, base + p + n))
        base += p + n
    ratios = tuple(sorted({r for r in cfg.compress_ratios if r}))
    meta = build_metadata(PrefillBatch(tuple(slices)), cache.req_to_token, slots, ratios)
    group = SingleCPGroup() if cp == 1 else FakeCPWorld(cp).group(rank)
    return ForwardContext.for_rank(meta, cache, group)


@pytest.mark.parametrize("cp", [1, 3])
def test_layer_bounds_cover_the_distinct_rows(cp: int) -> None:
    cfg = DeepseekV41Config.tiny()
    ctx = _context(cfg, [(40, 23), (0, 9), (5, 30)], cp=cp, rank=cp - 1)
    rows = ctx.local_rows
    for layer in range(cfg.num_hidden_layers):
        attn = DeepseekV41Attention(cfg, layer, dtype=torch.bfloat16)
        role = attn.role
        if role.compressed:  # a top-k over every visible entry: the most rows it can name
            n_vis = ctx.local.n_visible(role.ratio)
            j = torch.arange(int(n_vis.max()) + 1)
            ctx.cross = CrossLayer()
            topk = torch.where(j < n_vis[:, None], j, -1)
            ctx.cross.topk[role.ratio] = topk
        win, comp = attn.sparse_indices(ctx)
        swa_bound, comp_bound = attn.workspace_rows(ctx)
        assert _distinct(win) <= swa_bound, (layer, rows)
        if comp is not None:
            assert 0 < _distinct(comp) <= comp_bound, layer
        else:
            assert comp_bound == 0


@pytest.mark.parametrize("quant", ["none", "qat"])
@pytest.mark.slow
def test_layers_on_the_flashmla_path_equal_the_ops_path(
    monkeypatch: pytest.MonkeyPatch, quant: str
) -> None:
    """The roles of a small config with FlashMLA's head shape (64 × 512), three requests with
    cached prefixes: each layer's forward with its sparse attention sent to the FlashMLA path
    (the fake computing the ops' attention over the workspace) equals the ops path. The
    layer's `workspace_rows` travel with the call; a bound below the distinct rows would drop
    keys and show here."""
    from benchmarks.layer_peer_setup import build_layers

    import dsv4cp.layers.attention as layer_module

    mod = _install(monkeypatch, QatFakeFlashMLA() if quant == "qat" else FakeFlashMLA())
    cfg = DeepseekV41Config.tiny(num_attention_heads=64, head_dim=512, qk_rope_head_dim=64)
    ids = (0, 1, 3, 5)  # SWA, ratio-2 kv + index source, ratio-1 candidate source, consumer
    layers = build_layers(cfg, ids, torch.bfloat16, "cpu", quant=quant)  # type: ignore[arg-type]
    ctx = _context(cfg, [(20, 13), (0, 9), (37, 6)], quant=quant)
    x = torch.randn(ctx.meta.tokens.num_rows, cfg.hidden_size).bfloat16()
    seen: list[tuple[int, int] | None] = []

    def via_flashmla(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.get("workspace_rows"))
        return flashmla.sparse_attention_cached(*args, **kw)

    for i in ids:
        want = layers[i].forward(x, ctx)  # CPU: the ops twin
        with monkeypatch.context() as m:
            m.setattr(layer_module, "sparse_attention_cached", via_flashmla)
            got = layers[i].forward(x, ctx)
        assert torch.isfinite(got).all()
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), i
    assert len(seen) == len(ids) and all(s is not None for s in seen)
    assert len(mod.calls) == len(ids)  # every layer went through (fake) FlashMLA


# ------------------------------------------------------------------ the workspace, layer to layer


def count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each cache `attention_workspace._decode` reads from, one entry per call, from
    now on."""
    decoded: list[int] = []
    decode = attention_workspace._decode

    def counted(cache, src, fmt, d, out):  # type: ignore[no-untyped-def]
        decoded.append(cache.shape[0])
        decode(cache, src, fmt, d, out)

    monkeypatch.setattr(attention_workspace, "_decode", counted)
    return decoded


def test_the_next_layer_reuses_the_numbering_and_decodes_only_its_own_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A memo hit (the same index tensors): the same workspace tensors come back, the SWA rows
    decoded from the new layer's cache (equal to a fresh build over it), the compressed rows
    not decoded again; other index tensors (equal values), another bound or row span: a new
    build."""
    decoded = count_decodes(monkeypatch)
    q, swa, win, comp, top, sink = _caches(seed=3)
    swa2 = encode_rows(torch.randn(90, 512), FP8, dense_dtype=torch.bfloat16)
    memo = WorkspaceMemo()
    rows = slice(0, q.shape[0])
    first = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None)
    kv, idx = attention_workspace.build_workspace(first, rows, 512, torch.bfloat16, memo=memo)
    named_comp = idx[:, win.shape[1] :]
    named_comp = named_comp[named_comp >= 0].unique().long()
    comp_part = kv[named_comp].clone()
    second = attention_workspace.workspace_sources(swa2, win, comp, top, FP8, FP4, None)
    kv2, idx2 = attention_workspace.build_workspace(second, rows, 512, torch.bfloat16, memo=memo)
    assert kv2 is kv and idx2 is idx
    assert decoded == [90, 70, 90]  # both sources, then the new SWA cache only
    fresh_kv, fresh_idx = attention_workspace.build_workspace(second, rows, 512, torch.bfloat16)
    assert torch.equal(fresh_idx, idx2)
    named = idx2[idx2 >= 0].unique().long()
    assert torch.equal(kv2[named], fresh_kv[named])
    assert torch.equal(kv2[named_comp], comp_part)  # the same compressed cache: not re-decoded
    # the same caches again (fresh views): the SWA rows decoded again (a layer writes its SWA
    # cache before its attention), the compressed rows not
    kv3, _ = attention_workspace.build_workspace(
        attention_workspace.workspace_sources(swa2[:], win, comp, top, FP8, FP4, None), rows, 512,
        torch.bfloat16, memo=memo,
    )  # fmt: skip
    assert kv3 is kv and torch.equal(kv3[named], fresh_kv[named])
    assert decoded == [90, 70, 90, 90, 70, 90]  # + the fresh build's two, then SWA only
    for sources, span in (
        (attention_workspace.workspace_sources(swa2, win.clone(), comp, top, FP8, FP4, None), rows),
        (attention_workspace.workspace_sources(swa2, win, comp, top, FP8, FP4, (80, 70)), rows),
        (second, slice(0, q.shape[0] - 1)),
    ):
        kv4, _ = attention_workspace.build_workspace(sources, span, 512, torch.bfloat16, memo=memo)
        assert kv4 is not kv
        kv = kv4


def test_layers_share_the_workspace_and_equal_the_ops_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny config's six roles in order, one context, FlashMLA's head shape: each layer's
    output equals the ops path; the reuse layers take the window and the compressed rows the
    earlier layers made (the same tensors) and number no rows (no `mark_rows` call), the layers
    that write a compressed cache (and the first layer) number theirs; the consumer, which
    publishes a top-k over the candidate source's cache, reuses that numbering."""
    from benchmarks.layer_peer_setup import build_layers

    import dsv4cp.layers.attention as layer_module

    _install(monkeypatch, QatFakeFlashMLA())
    cfg = DeepseekV41Config.tiny(num_attention_heads=64, head_dim=512, qk_rope_head_dim=64)
    ids = tuple(range(cfg.num_hidden_layers))
    layers = build_layers(cfg, ids, torch.bfloat16, "cpu", quant="qat")
    ctx = _context(cfg, [(20, 13), (0, 9), (37, 6)], quant="qat")
    x = torch.randn(ctx.meta.tokens.num_rows, cfg.hidden_size).bfloat16()
    marks: list[int] = []
    numbered = attention_workspace.ops_rows.mark_rows

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        marks.append(1)
        return numbered(*a, **kw)

    monkeypatch.setattr(attention_workspace.ops_rows, "mark_rows", counted)
    want = {}
    for i in ids:  # the ops path, its own context (no FlashMLA, no workspace)
        want[i] = layers[i].forward(x, ctx)
    ctx = _context(cfg, [(20, 13), (0, 9), (37, 6)], quant="qat")
    windows, comps, per_layer = [], [], []
    monkeypatch.setattr(layer_module, "sparse_attention_cached", flashmla.sparse_attention_cached)
    for i in ids:
        before = len(marks)
        got = layers[i].forward(x, ctx)
        per_layer.append(len(marks) - before)
        windows.append(ctx.cross.attention.window)
        comps.append(ctx.cross.attention.comp)
        assert torch.allclose(got.float(), want[i].float(), atol=2e-2, rtol=2e-2), i
    assert all(w is windows[0] for w in windows)
    assert comps[2] is comps[1] and comps[4] is comps[3] and comps[5] is not comps[4]
    # layers 0, 1 and 3 mark the window's rows (the first layer, then the kv sources, which
    # empty the memo); the compressed rows are numbered densely (the batch's entries: a chunk
    # may name them all), so nothing marks them; the consumer (5) keeps layer 3's numbering
    assert per_layer == [1, 1, 0, 1, 0, 0]
