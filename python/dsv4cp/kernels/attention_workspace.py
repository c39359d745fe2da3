"""The chunk-bounded workspace that sparse attention over the quantized caches reads
(`kernels/flashmla.py` chooses the kernel over one dense source and indices, FlashMLA, the Gluon
one or the Triton cached kernel's math, and calls `over_workspace`). Per chunk of query rows the
cache rows the chunk's indices name are each decoded once into a workspace of static size and
the indices remapped into it, with no host sync (rows marked, numbered by a prefix sum; a source
with a dense row list numbered by the list; `build_workspace`). The chunk is bounded by
WORKSPACE_BUDGET_BYTES (`DSV4CP_FLASHMLA_WORKSPACE_MIB` overrides it; docs/performance.md has
the memory at 16K-token chunks up to 1M context); a one-chunk workspace may be kept for the next
layer in an `ops.workspace_rows.WorkspaceMemo`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv4cp import env_vars
from dsv4cp.kernels import workspace_rows as k_rows
from dsv4cp.kernels._triton import interpreting
from dsv4cp.kernels.kv_decode import decode_gather
from dsv4cp.ops import workspace_rows as ops_rows
from dsv4cp.ops.kv_format import decode_rows
from dsv4cp.ops.workspace_rows import WorkspaceMemo, same_rows

WORKSPACE_BUDGET_BYTES = 1 << 30  # bf16 workspace rows per FlashMLA call (the chunk's bound)
WORKSPACE_ENV = "DSV4CP_FLASHMLA_WORKSPACE_MIB"  # overrides the budget (MiB)
MIN_CHUNK_ROWS = 64  # fewer query rows per call than this: the bound is not worth splitting
# cache, indices [T, K], format, row bound, the rows a dense numbering lists (or None)
_CachedSource = tuple[Tensor, Tensor, str, int, Tensor | None]


def over_workspace(
    attend: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor],
    dtype: torch.dtype,
    q: Tensor,
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    sink: Tensor,
    scale: float,
    swa_format: str,
    comp_format: str,
    *,
    workspace_rows: tuple[int, int] | None = None,
    workspace_memo: WorkspaceMemo | None = None,
    comp_rows: Tensor | None = None,
) -> Tensor:
    """`attend` (a kernel over one dense source and indices) over the workspace of the rows the
    indices name, decoded into `dtype`, per chunk of query rows within the budget
    (`sparse_attention_cached`'s arguments; the backend already chosen)."""
    sources = workspace_sources(swa, swa_indices, comp, comp_indices, swa_format, comp_format,
                                workspace_rows, comp_rows)  # fmt: skip
    d = q.shape[2]
    spans = chunks(q.shape[0], sources, d * dtype.itemsize)
    if len(spans) == 1:  # the kernel's output is the result: no copy into another buffer
        kv, idx = build_workspace(sources, slice(0, q.shape[0]), d, dtype, memo=workspace_memo)
        return attend(q, kv, idx, sink, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for a, b in spans:
        kv, idx = build_workspace(sources, slice(a, b), d, dtype)
        out[a:b] = attend(q[a:b], kv, idx, sink, scale)
    return out


def workspace_sources(
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    swa_format: str,
    comp_format: str,
    workspace_rows: tuple[int, int] | None,
    comp_rows: Tensor | None = None,
) -> list[_CachedSource]:
    """(cache, indices, format, row bound, dense row list) per source; the bound is the
    caller's, else the cache's rows (a source's distinct rows never exceed either, nor T·K);
    the compressed source's bound is at most len(comp_rows), its dense list."""
    hint = workspace_rows or (swa.shape[0], comp.shape[0] if comp is not None else 0)
    out: list[_CachedSource] = [(swa, swa_indices, swa_format, min(int(hint[0]), swa.shape[0]),
                                 None)]  # fmt: skip
    if comp is not None and comp_indices is not None:
        bound = min(int(hint[1]), comp.shape[0])
        if comp_rows is not None:
            bound = min(bound, comp_rows.shape[0])
        out.append((comp, comp_indices, comp_format, bound, comp_rows))
    return out


def chunk_bound(sources: list[_CachedSource], rows: int) -> int:
    """Workspace rows a chunk of `rows` queries may need: per source min(rows·K, its bound)."""
    return sum(min(rows * idx.shape[1], bound) for _, idx, _, bound, _ in sources)


def _dense_lists(sources: list[_CachedSource], bounds: list[int]) -> list[Tensor | None]:
    """Per source, its dense row list where the chunk may name every listed row (its bound is
    the list's length), else None (numbered from the indices)."""
    return [
        rows if rows is not None and bound == rows.shape[0] and bound > 0 else None
        for (_, _, _, _, rows), bound in zip(sources, bounds)
    ]


def chunks(t: int, sources: list[_CachedSource], row_bytes: int) -> list[tuple[int, int]]:
    """Query row ranges whose workspace bound fits the budget (WORKSPACE_BUDGET_BYTES, or
    $DSV4CP_FLASHMLA_WORKSPACE_MIB), halving the chunk down to MIN_CHUNK_ROWS."""
    mib = env_vars.read(WORKSPACE_ENV)
    budget = WORKSPACE_BUDGET_BYTES if mib is None else int(mib * (1 << 20))
    step = max(t, 1)
    while step > MIN_CHUNK_ROWS and chunk_bound(sources, step) * row_bytes > budget:
        step = -(-step // 2)
    return [(a, min(t, a + step)) for a in range(0, t, step)]


def build_workspace(
    sources: list[_CachedSource],
    rows: slice,
    d: int,
    dtype: torch.dtype,
    memo: WorkspaceMemo | None = None,
) -> tuple[Tensor, Tensor]:
    """The rows the queries `rows` reference, each decoded once into a dense workspace, and their
    indices remapped into it: (kv [B, d] in dtype, int32 indices [t, ΣK], −1 kept).

    Per source, without a host sync (graph-capturable): mark the referenced cache rows, their
    prefix sum counts them (a marked row's number, 0…n−1 in row order, is its count − 1),
    `place_rows` lists the cache row of each workspace row
    (the i-th marked row; −1 past the count), the workspace row i is decoded from it,
    and an index becomes its row's number plus the source's offset, written into its source's
    columns (`workspace_rows`: Triton on CUDA and in the interpreter, the torch twins otherwise).
    B is the static bound `chunk_bound`; a count above it (a wrong bound) trips a device-side
    assert, never a silent wrong row. Rows past the count are never named and stay unwritten.
    A source with a dense row list whose bound is the list's length (the chunk may name every
    row on it) is numbered by the list instead: all its rows decoded in list order, an index
    remapped through `invert_rows` (no marks, no prefix sum).

    `memo` (`ops.workspace_rows.WorkspaceMemo`): when it holds a workspace numbered alike (the
    same index tensors, or for a dense source the same row list: the next layer of a forward),
    that workspace is returned with the first source (the SWA cache, which every layer writes
    before its attention) decoded again into its rows, a later source too when its cache is not
    the one decoded there, and a dense source's indices remapped when they are other tensors;
    else the new workspace is kept in it. The caller empties it when a later source's rows may
    have changed (the layer that writes the compressed cache: `sparse_rows.workspace_memo`).
    """
    span = (rows.start, rows.stop)
    bounds = [min((rows.stop - rows.start) * s[1].shape[1], s[3]) for s in sources]
    dense = _dense_lists(sources, bounds)
    device = sources[0][1].device
    numbering = k_rows if device.type == "cuda" or interpreting() else ops_rows
    if memo is not None and memo.same_numbering([s[1] for s in sources], bounds, span, d, dense):
        assert memo.kv is not None and memo.indices is not None and memo.kv.dtype == dtype
        col = 0
        for i, (cache, indices, fmt, _, _) in enumerate(sources):
            held, (base, bound), width = memo.sources[i], memo.spans[i], indices.shape[1]
            if i == 0 or not same_rows(cache, held[1]) or fmt != held[2]:
                _decode(cache, memo.src[i], fmt, d, memo.kv[base : base + bound])
            number = memo.number[i]
            if indices is not held[0] and number is not None:  # a dense source, another top-k
                part = memo.indices[:, col : col + width]
                numbering.remap_rows(indices[rows], number, part, base, bound)
            memo.sources[i] = (indices, cache, fmt)
            col += width
        return memo.kv, memo.indices
    kv = torch.empty((max(1, sum(bounds)), d), dtype=dtype, device=device)
    widths = [s[1].shape[1] for s in sources]
    out = torch.empty((rows.stop - rows.start, sum(widths)), dtype=torch.int32, device=device)
    base, col = 0, 0
    kept = memo if memo is not None else WorkspaceMemo()
    kept.hold(kv, out, span)
    for (cache, indices, fmt, _, _), bound, width, listed in zip(sources, bounds, widths, dense):
        idx, part = indices[rows], out[:, col : col + width]
        col += width
        n = cache.shape[0]
        kept.sources.append((indices, cache, fmt))
        kept.spans.append((base, bound))
        kept.dense.append(listed)
        if bound == 0:
            kept.src.append(torch.empty(0, dtype=torch.int32, device=device))
            kept.number.append(None)
            part.fill_(-1)
            continue
        inverted = None  # the dense list's numbering, kept for a later remap
        if listed is not None:  # every listed row, in list order
            src = listed.to(torch.int32)
            inverted = ops_rows.invert_rows(src, n)
            numbering.remap_rows(idx, inverted, part, base, bound)
        else:
            mark = torch.zeros(n, dtype=torch.int32, device=device)
            numbering.mark_rows(idx, mark)
            count = torch.cumsum(mark, 0, dtype=torch.int32)  # a marked row's number: count − 1
            if device.type == "cuda":
                torch._assert_async(count[-1] <= bound, "sparse_attention_cached: workspace bound")
            src = torch.empty(bound, dtype=torch.int32, device=device)
            numbering.place_rows(count, src)
            # number = count − 1: number < bound ⇔ count < bound + 1,
            # number + base = count + base − 1
            numbering.remap_rows(idx, count, part, base - 1, bound + 1)
        _decode(cache, src, fmt, d, kv[base : base + bound])
        kept.src.append(src)
        kept.number.append(inverted)
        base += bound
    return kv, out


def _decode(cache: Tensor, src: Tensor, fmt: str, d: int, out: Tensor) -> None:
    """out[i] = decoded cache[src[i]] for src[i] ≥ 0: the Triton decode on CUDA and in the
    interpreter, `ops.kv_format.decode_rows` on CPU tensors otherwise."""
    if cache.is_cuda or interpreting():
        decode_gather(cache, src, fmt, d, out)
        return
    keep = src >= 0
    rows = cache.index_select(0, src.long().clamp_min(0))
    vals = decode_rows(rows, fmt, d).to(out.dtype)
    out.copy_(torch.where(keep[:, None], vals, out))
