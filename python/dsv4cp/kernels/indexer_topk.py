"""Indexer logits fused with their selections: the [rows, width] logits never reach memory
(but for a plain top-k over ≤ LOGITS_ROUTE_MAX_WIDTH keys, below).

Twins of `dsv4cp.ops.indexer_topk` (attention-math §5.3): `mqa_topk` (full top-k),
`mqa_topk_candidates` (top-k plus the candidate source's published blocks) and
`mqa_topk_among_blocks` (a candidate consumer's top-k among its published blocks), all through
`launch_mqa_topk`, the host side: it checks the shapes, splits the rows into launches whose
buffers fit SCRATCH_BUDGET_BYTES and the width into pieces when the row blocks alone do not fill
the GPU, and picks the kernels:
- `indexer_topk_scan.scan_kernel`: logits tile by tile, each row's running top-k
  (`running_topk`), in the candidate source's (block maxima) or consumer's (membership map,
  `member_kernel`) mode;
- `indexer_topk_merge.merge_kernel`: the top K of the pieces' buffers, when there are pieces;
- before the scan, at widths of 4K and more, a seed per row from a sample of its columns
  (`plan_seed`): the scan takes only keys at or above it, and scans again without it the row
  blocks where a row ends with fewer than K keys (exact either way);
- `indexer_topk_gather`: a consumer at long context scores only its published blocks' keys.

The plain top-k (an index source) of a narrow context, or of a wide one with many rows, takes
the other route: the logits to memory in row chunks (`indexer_logits.mqa_logits`), then the
selection kernel (`topk.launch_topk`) — the ops twin's own composition, the same selection (GPU
test). Below LOGITS_ROUTE_MAX_WIDTH keys, and with at least one row per
LOGITS_ROUTE_KEYS_PER_ROW keys, that is faster than the scan, whose running top-k per row costs
more than the logits' trip to memory there (`benchmarks/indexer_scan.py --only
route=scan,route=logits`, docs/performance.md §13 on the H200, §36 on the H100 after the logits
kernel's qat steps were packed); a CP rank's few rows over a long context keep the scan.

quant="qat": the reference's bf16 index scores (`index_score`), so the selection is that of
`ops.attention_quant.index_scores_qat` and deterministic per row (CP = N equals CP = 1).

The layer's call over the index-key cache, `mqa_topk_cached`, is in `indexer_topk_cached`: it
decodes the keys into a dense workspace, then calls `launch_mqa_topk`.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from dsv4cp.kernels._triton import dot_flags
from dsv4cp.kernels.indexer_logits import check_mqa_logits
from dsv4cp.kernels.indexer_logits_int8 import encode_int8, scan_int8_args
from dsv4cp.kernels.indexer_topk_gather import launch_gather
from dsv4cp.kernels.indexer_topk_logits import logits_then_topk
from dsv4cp.kernels.indexer_topk_merge import merge_kernel
from dsv4cp.kernels.indexer_topk_plan import plan_gather, plan_pieces, plan_seed
from dsv4cp.kernels.indexer_topk_scan import member_kernel, scan_kernel
from dsv4cp.kernels.topk import launch_topk as _launch_topk
from dsv4cp.ops.quant import QuantMode, check_quant_mode

MAX_K = 2048
MAX_MERGE = 16384  # keys merged in registers per row: pieces · K, or pieces · CAP unreduced
MIN_PIECE = 4096  # narrowest piece worth a program
SCRATCH_BUDGET_BYTES = 512 << 20  # row-selection buffers (+ block maxima / map) per launch
LOGITS_ROUTE_MAX_WIDTH = 8192  # a plain top-k this narrow: logits to memory, then selection
# ... or wider, with at least one row per this many keys (docs/performance.md §36: on the H100
# the logits route won 1.10–1.32× at 1 row per 0.5–4 keys, the scan at 1 per 16 and more)
LOGITS_ROUTE_KEYS_PER_ROW = 4
TOPK_ROUTES = ("auto", "scan", "logits")
LOGITS_INT8 = True  # the logits route's qat logits on int8 MMAs (indexer_logits_int8)
SCAN_INT8 = False  # the scan's likewise, tile by tile (opt-in: the same selections, not timed)
SEED_REDO = True  # the redo of rows a seed left short (tests turn it off to see the seed prune)
# (BLOCK_T, BLOCK_N, num_warps, num_stages): the mqa_logits kernel's H200 default.
DEFAULT_CONFIG = (64, 128, 4, 2)
# Resident scan programs per SM by config: DEFAULT_CONFIG's 255 registers × 128 threads allow 2
# (ncu on the H200: "Block Limit Registers 2", benchmarks/results/ncu_scan_stalls_h200_2026-12-
# 03e.txt); other configs are planned as 1. Used only to plan the pieces (never correctness).
PROGRAMS_PER_SM = {DEFAULT_CONFIG: 2}


def check_mqa_topk(q: Tensor, weights: Tensor, k: Tensor, n_visible: Tensor, k_top: int) -> None:
    """Raise ValueError naming the limit when the kernels cannot take these shapes."""
    check_mqa_logits(q, weights, k, n_visible)
    if not 1 <= k_top <= MAX_K:
        raise ValueError(f"mqa_topk kernel: k_top must be in [1, {MAX_K}], got {k_top}")


def _pieces(
    rows: int, width: int, config: tuple[int, int, int, int], k_pad: int, device: torch.device
) -> tuple[int, int]:
    """(pieces, piece width): split the width when the row blocks alone do not fill the GPU."""
    block_t, block_n = config[0], config[1]
    sms = (
        4
        if device.type != "cuda"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )
    most = max(1, min(triton.cdiv(width, MIN_PIECE), MAX_MERGE // k_pad))
    pieces = plan_pieces(triton.cdiv(rows, block_t), sms, PROGRAMS_PER_SM.get(config, 1), most)
    piece_w = triton.cdiv(triton.cdiv(width, pieces), block_n) * block_n
    return triton.cdiv(width, piece_w), piece_w


def launch_mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    block_ids: Tensor | None = None,
    block_size: int = 8,
    max_blocks: int = 0,
    config: tuple[int, int, int, int] | None = None,
    pieces: int | None = None,
    cap: int | None = None,
    row_group: int = 4,
    consumer: str = "auto",
    quant: QuantMode = "none",
    key_bits: int | None = None,
    packed: bool = True,
    fill_logits: bool = False,
    int8_logits: bool | None = None,
    int8_scan: bool | None = None,
    route: str = "scan",
    seed_stride: int | None = None,
    seed_rank: int | None = None,
    mean_visible: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The three ops in one launcher: full top-k; with `max_blocks` > 0 also the candidate
    source's blocks; with `block_ids` the consumer's top-k among them. Knobs for benchmarks and
    tests: `config` (BLOCK_T, BLOCK_N, num_warps, num_stages), `pieces` (width splits), `cap`
    (row-buffer entries, a power of two ≥ k_top + BLOCK_N), `row_group` (rows cut at once),
    `consumer`: "map" scores every visible key and selects in the published blocks, "gather"
    scores only the published blocks' keys, "auto" picks by `plan_gather(width, published
    positions, mean_visible)` (`mean_visible`: the batch's mean visible keys per row, host-known;
    None: the width decides). `quant="qat"`: the reference's bf16 index
    scores (each head's term rounded as `index_scores_qat`, the head sum rounded once).
    `key_bits`: the high key bits every search walks — the running top-k's cuts
    (`running_topk`), the pieces' merge, the candidate blocks' and the logits route's selection
    (`topk.launch_topk`); default 16 in qat (the scores are bf16 values), else 32; 32 in qat is
    the slower equivalent.
    `packed`: qat's bf16 steps two values per inline-PTX block (`index_score`, GPU only; the
    same bits as `packed=False`, which rounds one value at a time). `fill_logits`: the logits
    route writes -inf to the logits its selection never reads (j ≥ n_visible; before §37 it
    did; the same selection). `int8_logits`: the logits route's qat logits on int8 MMAs
    (`indexer_logits_int8`, the same logits; None: LOGITS_INT8); `int8_scan`: the scan's, tile by
    tile (bf16 q, not the gather consumer; the same selections; None: SCAN_INT8). `route`:
    "scan" (the fused kernel, which the other knobs tune), "logits" (the plain top-k only:
    logits to memory, then the selection kernel), or "auto" (`pick_route`, what the layer's
    calls take).
    `seed_stride`, `seed_rank`: the scan's seed (`plan_seed`; 0 turns it off, default planned)."""
    check_mqa_topk(q, weights, k, n_visible, k_top)
    scan_knobs = (config, pieces, cap, row_group, consumer, seed_stride, seed_rank) != (
        (None,) * 3 + (4, "auto", None, None)
    )
    qat = check_quant_mode(quant) == "qat"
    key_bits = (16 if qat else 32) if key_bits is None else key_bits
    if key_bits not in ((16, 32) if qat else (32,)):
        raise ValueError(
            f"mqa_topk kernel: key_bits {key_bits} must be 32, or 16 in qat (bf16 scores)"
        )
    t, h, d = q.shape
    n = k.shape[0]
    width = n if width is None else int(width)
    member_mode = block_ids is not None
    if member_mode and max_blocks:
        raise ValueError("mqa_topk kernel: block_ids (consumer) and max_blocks (source) exclude")
    if (member_mode or max_blocks) and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"mqa_topk kernel: block_size must be a power of two, got {block_size}")
    if k_start is not None and k_start.shape != (t,):
        raise ValueError(f"mqa_topk: k_start must be [{t}], got {tuple(k_start.shape)}")
    use_logits = pick_route(route, width, member_mode or max_blocks > 0, t) == "logits"
    if use_logits and scan_knobs:
        raise ValueError("mqa_topk kernel: the scan's knobs were given to the logits route")
    if block_ids is not None and (block_ids.dim() != 2 or block_ids.shape[0] != t):
        raise ValueError(f"mqa_topk: block_ids must be [{t}, B], got {tuple(block_ids.shape)}")
    block_t, block_n, warps, stages = config or DEFAULT_CONFIG
    if (member_mode or max_blocks) and block_n % block_size:
        raise ValueError(f"mqa_topk kernel: BLOCK_N {block_n} not a multiple of {block_size}")
    k_pad = triton.next_power_of_2(k_top)
    cap = cap or triton.next_power_of_2(max(2 * k_top, k_top + 2 * block_n))
    if cap & (cap - 1) or cap < k_top + block_n:
        raise ValueError(f"mqa_topk kernel: cap {cap} must be a power of two ≥ k_top + BLOCK_N")
    out = torch.empty((t, k_top), dtype=torch.int32, device=q.device)
    blocks_out = (
        torch.empty((t, max_blocks), dtype=torch.int32, device=q.device) if max_blocks else None
    )
    if t == 0:
        return out, blocks_out
    if width == 0:
        out.fill_(-1)
        if blocks_out is not None:
            blocks_out.fill_(-1)
        return out, blocks_out
    if use_logits:
        int8 = LOGITS_INT8 if int8_logits is None else int8_logits
        return logits_then_topk(
            q, weights, k, n_visible, k_top, k_start, width, quant, key_bits, packed,
            fill_logits, int8,
        ), None  # fmt: skip
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(1) != 1:
        k = k.contiguous()
    weights = weights.float()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    n_visible = n_visible.contiguous()
    nb = triton.cdiv(width, block_size) if (member_mode or max_blocks) else 1
    if block_ids is not None:
        if consumer not in ("auto", "map", "gather"):
            raise ValueError(f"mqa_topk kernel: consumer must be auto/map/gather, got {consumer!r}")
        wide = plan_gather(width, block_ids.shape[1] * block_size, mean_visible)
        if consumer == "gather" or (consumer == "auto" and wide):
            launch_gather(q, weights, k, n_visible, k_start, block_ids, out, width, block_size,
                           block_n, cap, nb, qat, key_bits, packed)  # fmt: skip
            return out, None
    int8 = qat and q.dtype == torch.bfloat16 and (SCAN_INT8 if int8_scan is None else int8_scan)
    k8 = encode_int8(k) if int8 else None  # the keys' codes, once for every launch
    same = dict(  # the scan launches' common arguments: the sample's, the seeded, the redo
        RG=row_group,
        KEY_BITS=key_bits,
        HAS_KSTART=k_start is not None,
        BS=block_size,
        D=d,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        STAGES=stages,
        **dot_flags(q.dtype),
        QAT=qat,
        PACKED=packed,
        num_warps=warps,
        num_stages=stages,
    )

    def plan(rows: int) -> tuple[int, int]:
        if pieces is None:
            return _pieces(rows, width, (block_t, block_n, warps, stages), k_pad, q.device)
        piece_w = triton.cdiv(triton.cdiv(width, pieces), block_n) * block_n
        return triton.cdiv(width, piece_w), piece_w

    stride, rank = plan_seed(width, k_top, member_mode, seed_stride, seed_rank)
    cap_s = triton.next_power_of_2(max(2 * rank, rank + 2 * block_n)) if stride else 0
    # Rows per launch: whole row blocks whose buffers (and block maxima or map) fit the budget.
    step = t
    per_row = (8 * cap_s + 17 if stride else 0) + 5 * nb  # the seed's buffers, seed, flag
    while step > block_t and step * (8 * cap * plan(step)[0] + per_row) > SCRATCH_BUDGET_BYTES:
        step = max(block_t, step // 2 // block_t * block_t)
    for a in range(0, t, step):
        b = min(t, a + step)
        rows = b - a
        p, piece_w = plan(rows)
        sk = torch.empty((rows * p, cap), dtype=torch.int32, device=q.device)
        si = torch.empty_like(sk)
        cnt = torch.empty((rows * p,), dtype=torch.int32, device=q.device)
        tau = torch.empty_like(cnt)
        nv = n_visible[a:b]
        bmax = torch.empty((rows, nb), dtype=torch.float32, device=q.device) if max_blocks else cnt
        member = cnt
        if member_mode:
            assert block_ids is not None
            ids = block_ids[a:b]
            if ids.stride(1) != 1:
                ids = ids.contiguous()
            member = torch.zeros((rows, nb), dtype=torch.uint8, device=q.device)
            if ids.shape[1]:
                member_kernel[(rows,)](
                    ids, member, nb, ids.shape[1], ids.stride(0),
                    MB_PAD=triton.next_power_of_2(ids.shape[1]),
                )  # fmt: skip
        o = out[a:b]
        i8, i8_flags = scan_int8_args(q[a:b], weights[a:b], k8, cnt)
        ks = nv if k_start is None else k_start[a:b].contiguous()
        strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(0), o.stride(0))
        # the pieces' running buffers go to the merge as they are when they all fit its registers
        raw = p > 1 and p * cap <= MAX_MERGE
        w_pad = cap if raw else k_pad
        seed = redo = cnt  # placeholders where there is no seed
        if stride:  # the seed: the rank-th largest key of every stride-th visible column
            seed = torch.empty((rows,), dtype=torch.int32, device=q.device)
            redo = torch.empty((rows,), dtype=torch.int8, device=q.device)
            sk_s = torch.empty((rows, cap_s), dtype=torch.int32, device=q.device)
            si_s, cnt_s = torch.empty_like(sk_s), torch.empty_like(seed)
            nv_s = (nv.clamp(0, width) + stride - 1) // stride
            width_s = triton.cdiv(width, stride)
            scan_kernel[(triton.cdiv(rows, block_t), 1)](  # its last cut's τ is the seed
                q[a:b], weights[a:b], k, nv_s, ks, member, bmax, sk_s, si_s, cnt_s, seed, o, seed,
                redo, *i8, rows, h, n, width_s, 1, triton.cdiv(width_s, block_n) * block_n, nb,
                *strides, K=rank, K_PAD=triton.next_power_of_2(rank), CAP=cap_s, MEMBER=False,
                BLOCK_MAX=False, DIRECT=False, PREFIX=False, FINAL_CUT=True, COL_STRIDE=stride,
                SEEDED=False, REDO=False, **same, **i8_flags,
            )  # fmt: skip
        passes = ((True, False), (False, True))[: 1 + SEED_REDO] if stride else ((False, False),)
        for seeded, again in passes:  # with a seed: the seeded pass, then the redo of short rows
            scan_kernel[(triton.cdiv(rows, block_t), p)](
                q[a:b], weights[a:b], k, nv, ks, member, bmax, sk, si, cnt, tau, o, seed, redo, *i8,
                rows, h, n, width, p, piece_w, nb, *strides,
                K=k_top, K_PAD=k_pad, CAP=cap, MEMBER=member_mode,
                BLOCK_MAX=bool(max_blocks) and not again, DIRECT=p == 1, PREFIX=not member_mode,
                FINAL_CUT=not raw, COL_STRIDE=1, SEEDED=seeded, REDO=again, **same, **i8_flags,
            )  # fmt: skip
            if p > 1:
                merge_kernel[(rows,)](
                    sk, si, cnt, nv, o, redo, width, p, o.stride(0),
                    K=k_top, K_PAD=k_pad, P_PAD=triton.next_power_of_2(p), CAP=cap,
                    W_PAD=w_pad, PREFIX=not member_mode, KEY_BITS=key_bits, FLAG=seeded,
                    REDO=again,
                    num_warps=max(4, min(16, triton.next_power_of_2(max(1, p * w_pad // 1024)))),
                )  # fmt: skip
        if blocks_out is not None:
            n_blocks = (nv.clamp(0, width) + block_size - 1) // block_size
            blocks_out[a:b] = _launch_topk(bmax, n_blocks, max_blocks, key_bits=key_bits)
    return out, blocks_out


def pick_route(route: str, width: int, blocks: bool, rows: int = 0) -> str:
    """ "scan" or "logits" for a launch of `rows` query rows over this `width`; `blocks`: a
    candidate source's or consumer's selection (those always scan). Auto takes the logits route
    for a plain top-k over ≤ LOGITS_ROUTE_MAX_WIDTH keys, or over more when the rows are at
    least a 1 / LOGITS_ROUTE_KEYS_PER_ROW share of the width (a cold prefill or a chunk after a
    prefix up to ~4× its length; a CP rank's few rows over a long context keep the scan)."""
    if route not in TOPK_ROUTES:
        raise ValueError(f"mqa_topk kernel: route must be one of {TOPK_ROUTES}, got {route!r}")
    if route == "logits" and blocks:
        raise ValueError("mqa_topk kernel: the logits route takes the plain top-k only")
    if route == "auto":
        many_rows = rows * LOGITS_ROUTE_KEYS_PER_ROW >= width
        return "logits" if not blocks and (width <= LOGITS_ROUTE_MAX_WIDTH or many_rows) else "scan"
    return route


def mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer_topk.mqa_topk: int32 [T, k_top], ascending, -1 pads."""
    return launch_mqa_topk(
        q, weights, k, n_visible, k_top, k_start=k_start, width=width, quant=quant, route="auto"
    )[0]


def mqa_topk_candidates(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    block_size: int,
    max_blocks: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> tuple[Tensor, Tensor]:
    """Triton twin of ops.indexer_topk.mqa_topk_candidates (the blocks equal candidate_blocks
    whenever the visible logits are finite, as they are for finite inputs)."""
    if max_blocks < 1:
        raise ValueError(f"mqa_topk_candidates: max_blocks must be ≥ 1, got {max_blocks}")
    top, blocks = launch_mqa_topk(
        q, weights, k, n_visible, k_top,
        k_start=k_start, width=width, block_size=block_size, max_blocks=max_blocks, quant=quant,
    )  # fmt: skip
    assert blocks is not None
    return top, blocks


def mqa_topk_among_blocks(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    block_ids: Tensor,
    block_size: int,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer_topk.mqa_topk_among_blocks: int32 [T, k_top], -1 pads."""
    return launch_mqa_topk(
        q, weights, k, n_visible, k_top,
        k_start=k_start, width=width, block_ids=block_ids, block_size=block_size, quant=quant,
    )[0]  # fmt: skip
