"""CPU: `kernels/topk.slot_piece`, the slots merge's piece width (docs/performance.md §38), and
which merge `launch_topk` takes for a width without running a kernel (an empty batch)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv4cp.kernels.topk import MAX_MERGE, launch_topk, slot_piece  # noqa: E402


@pytest.mark.parametrize(
    ("w", "k", "piece"),
    [
        (300, 24, 512),  # narrower than a piece: one piece as wide as the row (a power of two)
        (8192, 512, 4096),  # cold 16K, the int32 keys' search: two 4K pieces
        (16384, 512, 4096),
        (16385, 512, 8192),  # wider than 16K: 8K pieces
        (65536, 512, 8192),
        (262144, 512, 8192),  # 32 pieces × 512 = MAX_MERGE
        (262145, 512, 16384),  # 8K pieces' slots would not fit: 16K pieces
        (524288, 512, 16384),
        (524289, 512, None),  # nothing fits: the stream merge
        (8192, 4096, 4096),  # k = MAX_K: 2 × 4096 slots
        (65536, 2048, 8192),  # the candidate source's block selection at 64K blocks
    ],
)
def test_slot_piece(w: int, k: int, piece: int | None) -> None:
    assert slot_piece(w, k) == piece
    if piece is not None:
        pieces = -(-w // piece)
        assert (1 << (pieces - 1).bit_length()) * (1 << (k - 1).bit_length()) <= MAX_MERGE


@pytest.mark.parametrize(
    ("w", "piece"),
    [(300, 512), (8192, 8192), (16384, 8192), (65536, 8192), (262145, 16384), (524289, None)],
)
def test_slot_piece_of_the_bf16_pair_search(w: int, piece: int | None) -> None:
    """The search over bf16 pairs (key_bits 16) takes 8K pieces from the narrowest rows on."""
    assert slot_piece(w, 512, packed=True) == piece


def test_merge_choice_and_refusals() -> None:
    empty = torch.zeros(0, 524289)
    nv = torch.zeros(0, dtype=torch.long)
    assert launch_topk(empty, nv, 512).shape == (0, 512)  # too wide for slots: streams
    with pytest.raises(ValueError, match="cannot hold"):
        launch_topk(empty, nv, 512, merge="slots")
    with pytest.raises(ValueError, match="apply to merge='stream' only"):
        launch_topk(torch.zeros(0, 100), torch.zeros(0, dtype=torch.long), 8, cap=64)
    with pytest.raises(ValueError, match="merge must be"):
        launch_topk(torch.zeros(0, 100), torch.zeros(0, dtype=torch.long), 8, merge="heap")
    with pytest.raises(ValueError, match="piece must be a power of two"):
        launch_topk(torch.zeros(0, 100), torch.zeros(0, dtype=torch.long), 8, piece=48)
