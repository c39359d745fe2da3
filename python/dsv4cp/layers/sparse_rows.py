"""The cache rows one attention layer's sparse attention reads, and the bounds of its workspace.

`sparse_indices`: the int32 rows of the layer's SWA cache (the window) and, on compressed layers,
of its kv source's compressed cache (the top-k entries), memoised in `ctx.cross.attention` for
the later layers that read the same rows. `workspace_rows`: upper bounds on the distinct rows
those indices name, from the batch's shapes (FlashMLA's bf16 workspace,
`kernels/attention_workspace.py`).
`comp_rows`: every compressed cache row of the batch's entries (the workspace's dense list).
`workspace_memo`: the forward's kept workspace. `DeepseekV41Attention.attend` calls them with
its role and window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.context import ForwardContext
from dsv4cp.ops.workspace_rows import WorkspaceMemo
from dsv4cp.roles import LayerRole
from dsv4cp.routing import window_rows


def kv_source(role: LayerRole) -> int:
    """The layer whose compressed and index caches a compressed layer reads."""
    src = role.kv_source
    if src is None:
        raise ValueError(f"layer {role.layer}: a compressed layer needs a kv source")
    return src


def sparse_indices(
    role: LayerRole, window: int, ctx: ForwardContext
) -> tuple[Tensor, Tensor | None]:
    """int32 rows of the layer's SWA cache [L, W] (the window) and, on compressed layers,
    of the kv source's compressed cache [L, K_top] (the top-k entries); −1 = none.

    The same tensors for every layer that reads the same rows (`ctx.cross.attention`): the
    window's rows are the same in every layer, the compressed rows in every layer that reads
    its kv source through the same top-k; the layer that publishes a top-k makes them."""
    local, cache, memo = ctx.local, ctx.cache, ctx.cross.attention
    win = memo.window
    if win is None or win.shape[1] != window:
        # ascending position, -1 pads last, as the reference's `get_window_topk_idxs` and
        # sorted top-k do: the attention's fp32 sums then add the same terms in that order
        win = memo.window = window_rows(
            local.positions,
            local.valid,
            local.req_row,
            local.req_to_token,
            window,
            *cache.swa_pool_map,
        )
    if not role.compressed:
        return win, None
    r, topk_from = role.ratio, role.topk_from
    assert topk_from is not None
    key = (r, kv_source(role), topk_from)
    if memo.comp is None or memo.comp_key != key or role.index_source:
        comp = cache.entry_rows(r, local.entry_slots(r, ctx.cross.topk[r]))
        memo.comp, memo.comp_key = comp.to(torch.int32), key
    return win, memo.comp


def workspace_rows(role: LayerRole, window: int, ctx: ForwardContext) -> tuple[int, int]:
    """Upper bounds, from the batch's shapes (no host sync), on the distinct SWA rows and
    compressed rows this rank's sparse indices name: each request's window reaches at most
    W − 1 positions before its new tokens, and the top-k entries are the ratio's workspace
    entries. Sizes FlashMLA's bf16 workspace (`kernels/attention_workspace.py`)."""
    meta = ctx.meta
    t = meta.tokens.num_rows
    if meta.batch is not None:
        requests = len(meta.batch.requests)
    else:  # a graph bucket's static metadata: its workspaces have a row per request
        offsets = [ws.request_offset.shape[0] for ws in meta.workspaces.values()]
        requests = max(offsets) if offsets else t
    swa = t + (window - 1) * requests
    if not role.compressed:
        return swa, 0
    return swa, int(meta.workspaces[role.ratio].slots.shape[0])


def comp_rows(role: LayerRole, ctx: ForwardContext) -> Tensor | None:
    """int32 [N]: the compressed cache row of each of the batch's entries of the layer's ratio
    (`CompressedWorkspace.slots`, the global batch's, in workspace order), the only rows its
    top-k rows name; None on a layer without compressed keys. One tensor per ratio and forward
    (`ctx.cross.attention.entry_rows`), so the layers reading it share a dense workspace."""
    if not role.compressed:
        return None
    memo, r = ctx.cross.attention, role.ratio
    if r not in memo.entry_rows:
        slots = ctx.meta.workspaces[r].slots
        memo.entry_rows[r] = ctx.cache.entry_rows(r, slots).to(torch.int32)
    return memo.entry_rows[r]


def workspace_memo(role: LayerRole, ctx: ForwardContext) -> WorkspaceMemo:
    """The forward's sparse-attention workspace memo (`ctx.cross.attention.workspace`),
    emptied by a layer that writes a compressed cache (a kv source: the rows the memo holds
    decoded may be its cache's, now rewritten). A layer reading another layer's cache through
    its own top-k (a consumer) keeps it: that cache is written once per forward, before."""
    memo = ctx.cross.attention
    if not isinstance(memo.workspace, WorkspaceMemo) or role.owns_compressor:
        memo.workspace = WorkspaceMemo()
    return memo.workspace
