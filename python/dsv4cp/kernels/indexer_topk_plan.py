"""The host-side plans of the fused indexer scan (`indexer_topk.launch_mqa_topk`), pure
functions of the shapes: how many width pieces fill the GPU (`plan_pieces`), the seed's sample
stride and rank (`plan_seed`), and a candidate consumer's mode (`plan_gather`)."""

from __future__ import annotations

import triton

SEED_SAMPLE = 512  # sampled columns per row for the seed: every (width // SEED_SAMPLE)-th
SEED_MIN_STRIDE = 8  # no seed below a stride of 8 (widths < 4K: few cuts to save)
GATHER_WIDTH_RATIO = 4  # without a mean: gather when the width is ≥ 4x the published positions
GATHER_VISIBLE_RATIO = 3  # gather when the rows see ≥ 3x the published positions on average


def plan_pieces(row_blocks: int, sms: int, per_sm: int, most: int) -> int:
    """Width pieces of `row_blocks` programs each. When the row blocks fill a wave of resident
    programs (sms · per_sm) alone: 1. Else the count whose programs run in the fewest waves per
    piece of width — waves(p) / p, waves(p) = ⌈row_blocks · p / (sms · per_sm)⌉ — among
    1..most; of equal ones, the nearest to ⌈2 · sms / row_blocks⌉ (two programs per SM, what
    was planned before waves were counted). At 4096 rows (64 blocks) on 132 SMs × 2: 4 pieces
    fill one wave (256 programs), where 5 took two (320) for 1/4 more work each."""
    if row_blocks < 1 or sms < 1 or per_sm < 1 or most < 1:
        raise ValueError(f"plan_pieces: {row_blocks=}, {sms=}, {per_sm=}, {most=} must be ≥ 1")
    slots = sms * per_sm
    if row_blocks >= slots:
        return 1
    want = triton.cdiv(2 * sms, row_blocks)

    def rank(p: int) -> tuple[float, int]:
        return (triton.cdiv(row_blocks * p, slots) / p, abs(p - want))

    return min(range(1, most + 1), key=rank)


def plan_seed(
    width: int, k_top: int, consumer: bool, stride: int | None, rank: int | None
) -> tuple[int, int]:
    """(stride, rank) of the scan's seed, (0, 0) for none. The seed of a row is the rank-th
    largest key among its visible columns 0, stride, 2·stride, …; the scan then takes only keys
    ≥ it, which spares the cuts of a running top-k that starts empty in every piece. Exact
    whenever at least k_top keys of the row reach the seed (then its top k_top all do); a row
    where fewer do is found after the pass (its buffers hold < k_top keys) and scanned again
    without a seed. The planned rank puts the expected count of sampled keys among a row's top
    k_top (μ = k_top / stride, for columns in random order) well under it: 3μ + 8, so a row
    keeps ~3·k_top + 8·stride keys. Consumers (scores restricted to their blocks) take none."""
    if stride is None:
        stride = 0 if consumer else width // SEED_SAMPLE
        stride = stride if stride >= SEED_MIN_STRIDE else 0
    if stride < 0 or (stride and consumer) or (rank is not None and rank < 1):
        raise ValueError(f"mqa_topk kernel: seed_stride {stride} / rank {rank} not usable here")
    if stride <= 1:
        return 0, 0
    return stride, rank or 3 * triton.cdiv(k_top, stride) + 8


def plan_gather(width: int, published: int, mean_visible: float | None) -> bool:
    """Whether a candidate consumer gathers its published blocks' keys (`launch_gather`: cost per
    row ∝ `published` positions, one row per product) rather than scanning every visible key
    (the scan's map mode: cost ∝ the visible keys, with a key tile shared by a block of rows).
    On the H100 (docs/performance.md §22) the gather ran ~110 ms per 10⁹ scored keys and the
    map 28–46 ms per 10⁹ visible keys, so the gather pays from about 2.4–3.9x as many visible
    keys per row as published positions: measured, 2x (a cold 64K prefill) favours the map by
    12 %, 3x (cold 96K) the gather by 22 %, 7.5x (a 16K chunk after 112K) the gather by 2x.
    `mean_visible` — the batch's mean visible keys per new token, host-known
    (`batch.CompressedWorkspace.mean_visible`) and the same on every CP rank — decides at
    GATHER_VISIBLE_RATIO; without it (a CUDA graph's static bucket) the width, an upper bound of
    the mean, decides at GATHER_WIDTH_RATIO as before."""
    if mean_visible is None:
        return width >= GATHER_WIDTH_RATIO * published
    return mean_visible >= GATHER_VISIBLE_RATIO * published
