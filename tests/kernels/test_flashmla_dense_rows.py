"""The FlashMLA workspace's dense numbering of the compressed source
(`kernels/attention_workspace.py`), on the CPU with a fake `flash_mla`.

Where a chunk may name every compressed row of the batch (its bound is the batch's entries), the
layer's list of those rows (`sparse_rows.comp_rows`) numbers the workspace instead of the marks:
every listed row decoded, in list order, an index remapped through `invert_rows`. The numbering
then does not depend on the top-k, so a consumer reading the candidate source's cache through
its own top-k keeps the decode the layers before it made and only remaps its indices. Checked
here: the inversion, the workspace against the marked one (the same keys in the same order, so
the same attention bit for bit), the memo across a new top-k, and which layers empty the memo.
The real wheel and the Triton remap on the GPU: `tests/gpu/test_flashmla_dense_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops
from dsv4cp.config import DeepseekV41Config
from dsv4cp.kernels import attention_workspace, flashmla
from dsv4cp.layers import sparse_rows
from dsv4cp.ops import workspace_rows as ops_rows
from dsv4cp.ops.kv_format import decode_rows, encode_rows
from dsv4cp.ops.workspace_rows import WorkspaceMemo
from tests.kernels.test_flashmla_cached import (
    FP4,
    FP8,
    QatFakeFlashMLA,
    _caches,
    _context,
    _install,
    count_decodes,
)


def test_invert_rows_numbers_the_list_and_nothing_else() -> None:
    rows = torch.tensor([3, -1, 0, 7], dtype=torch.int32)  # −1 and 7 (≥ n) are not rows
    number = ops_rows.invert_rows(rows, 5)
    assert number.dtype == torch.int32 and number.is_contiguous()
    assert number.tolist() == [2, 4, 4, 0, 4]  # unlisted rows: len(rows), past any number
    idx = torch.tensor([[3, 0, 1, -1, 9, 4]])
    out = torch.empty_like(idx, dtype=torch.int32)
    ops_rows.remap_rows(idx, number, out, 10, rows.shape[0])
    assert out.tolist() == [[10, 12, -1, -1, -1, -1]]


def _listed(comp: torch.Tensor, seed: int, drop: int = 0) -> torch.Tensor:
    """The cache's rows in a shuffled order (as the batch's entries lie in the pool), `drop`
    of them left out."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(comp.shape[0], generator=g)[drop:].to(torch.int32)


@pytest.mark.parametrize("drop", [0, 10])
def test_dense_workspace_reads_the_same_keys_as_the_marked_one(drop: int) -> None:
    q, swa, win, comp, top, sink = _caches(seed=4)
    listed = _listed(comp, seed=4, drop=drop)
    top = torch.where(torch.isin(top, listed.long()), top, -1)  # name only listed rows
    rows = slice(0, q.shape[0])
    marked = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None)
    dense = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None, listed)
    assert (
        dense[1][3] == listed.shape[0]
        and attention_workspace._dense_lists(dense, [90, 70 - drop])[1] is listed
    )
    kv_m, idx_m = attention_workspace.build_workspace(marked, rows, 512, torch.bfloat16)
    kv_d, idx_d = attention_workspace.build_workspace(dense, rows, 512, torch.bfloat16)
    w = win.shape[1]
    assert torch.equal(idx_d[:, :w], idx_m[:, :w])  # the SWA source is numbered as before
    v = top >= 0
    assert torch.equal(idx_d[:, w:] >= 0, v)
    want = decode_rows(comp, FP4, 512)
    assert torch.equal(kv_d[idx_d[:, w:][v].long()].float(), want[top[v]])
    # every listed row decoded, in list order, after the SWA rows' bound
    assert kv_d.shape[0] == 90 + listed.shape[0]
    assert torch.equal(kv_d[90:].float(), want[listed.long()])
    # the attention over either workspace: the same keys in the same order, bit for bit
    att = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, "qat")
    kw = dict(workspace_rows=(90, 70 - drop))
    fake = QatFakeFlashMLA()
    out_m = fake.flash_mla_sparse_fwd(q, kv_m[:, None], idx_m[:, None], 512**-0.5,
                                      attn_sink=sink)[0]  # fmt: skip
    out_d = fake.flash_mla_sparse_fwd(q, kv_d[:, None], idx_d[:, None], 512**-0.5,
                                      attn_sink=sink)[0]  # fmt: skip
    assert torch.equal(out_d, out_m)
    assert torch.equal(ops.sparse_attention_cached(*att, comp_rows=listed, **kw),
                       ops.sparse_attention_cached(*att))  # fmt: skip


def test_a_chunk_that_cannot_name_every_listed_row_is_marked() -> None:
    """Chunks of 1 query row name at most K = 40 compressed rows < 70 listed: the marks."""
    q, swa, win, comp, top, sink = _caches(seed=5)
    sources = attention_workspace.workspace_sources(
        swa, win, comp, top, FP8, FP4, None, _listed(comp, 5)
    )
    bounds = [min(16, 90), min(40, 70)]
    assert attention_workspace._dense_lists(sources, bounds) == [None, None]


def test_fake_flashmla_with_the_dense_list_equals_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, QatFakeFlashMLA())
    q, swa, win, comp, top, sink = _caches(seed=6)
    listed = _listed(comp, 6)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, "qat")
    plain = flashmla.sparse_attention_cached(*args)
    assert torch.equal(flashmla.sparse_attention_cached(*args, comp_rows=listed), plain)
    monkeypatch.setattr(attention_workspace, "WORKSPACE_BUDGET_BYTES", 1)
    # chunks of 2 rows: 80 ≥ 70, dense
    monkeypatch.setattr(attention_workspace, "MIN_CHUNK_ROWS", 2)
    assert torch.equal(flashmla.sparse_attention_cached(*args, comp_rows=listed), plain)


def test_a_new_topk_over_the_same_cache_remaps_without_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer's case: the held workspace numbered the compressed rows from the list; a
    call with another top-k tensor over the same cache and list returns the same tensors, the
    compressed rows not decoded again, its indices equal to a fresh build's; another cache
    decodes them again; another list tensor (equal values) builds anew."""
    decoded = count_decodes(monkeypatch)
    q, swa, win, comp, top, sink = _caches(seed=7)
    top2 = torch.flip(top, [0])  # another top-k, the same rows' shapes
    listed, rows, memo = _listed(comp, 7), slice(0, q.shape[0]), WorkspaceMemo()
    first = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None, listed)
    kv, idx = attention_workspace.build_workspace(first, rows, 512, torch.bfloat16, memo=memo)
    comp_part = kv[90:].clone()
    swa2 = encode_rows(torch.randn(90, 512), FP8, dense_dtype=torch.bfloat16)
    second = attention_workspace.workspace_sources(swa2, win, comp, top2, FP8, FP4, None, listed)
    kv2, idx2 = attention_workspace.build_workspace(second, rows, 512, torch.bfloat16, memo=memo)
    assert kv2 is kv and idx2 is idx
    assert decoded == [90, 70, 90]  # both sources, then the new SWA cache only
    assert torch.equal(kv2[90:], comp_part)
    fresh_kv, fresh_idx = attention_workspace.build_workspace(second, rows, 512, torch.bfloat16)
    assert torch.equal(idx2, fresh_idx)
    named = idx2[idx2 >= 0].unique().long()
    assert torch.equal(kv2[named], fresh_kv[named])
    comp2 = encode_rows(torch.randn(70, 512), FP4, dense_dtype=torch.bfloat16)
    third = attention_workspace.workspace_sources(swa2, win, comp2, top, FP8, FP4, None, listed)
    decoded.clear()
    kv3, idx3 = attention_workspace.build_workspace(third, rows, 512, torch.bfloat16, memo=memo)
    assert kv3 is kv and decoded == [90, 70]  # another compressed cache: decoded again
    assert torch.equal(kv3[90:].float(), decode_rows(comp2, FP4, 512)[listed.long()])
    assert torch.equal(idx3, idx)  # the first top-k's indices, remapped back
    again = attention_workspace.workspace_sources(
        swa2, win, comp2, top, FP8, FP4, None, listed.clone()
    )
    kv4, _ = attention_workspace.build_workspace(again, rows, 512, torch.bfloat16, memo=memo)
    assert kv4 is not kv


def test_the_memo_is_emptied_by_kv_sources_only() -> None:
    """Tiny roles: 1 (r2 kv source), 3 (r1 kv + candidate source) empty the forward's memo; 2
    and 4 (reuse) and 5 (consumer: its own top-k over layer 3's cache) keep it; the list of the
    batch's compressed rows is one tensor per ratio and forward."""
    cfg = DeepseekV41Config.tiny()
    ctx = _context(cfg, [(20, 13), (0, 9)])
    roles = cfg.layer_roles()
    kept = sparse_rows.workspace_memo(roles[0], ctx)
    emptied = []
    for role in roles[1:]:
        memo = sparse_rows.workspace_memo(role, ctx)
        emptied.append(memo is not kept)
        kept = memo
    assert emptied == [r.owns_compressor for r in roles[1:]] == [True, False, True, False, False]
    assert sparse_rows.comp_rows(roles[0], ctx) is None
    r1 = sparse_rows.comp_rows(roles[3], ctx)
    assert r1 is not None and sparse_rows.comp_rows(roles[5], ctx) is r1
    ws = ctx.meta.workspaces[1]
    assert r1.dtype == torch.int32 and torch.equal(r1.long(), ctx.cache.entry_rows(1, ws.slots))
    assert r1.shape[0] == sparse_rows.workspace_rows(roles[5], 128, ctx)[1]
