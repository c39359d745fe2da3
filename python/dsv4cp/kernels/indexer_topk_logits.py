"""The plain top-k's logits route (`indexer_topk.pick_route`: a narrow width, or a row per few
keys): the [rows, width] logits in row chunks within `ops.indexer_topk.LOGITS_BUDGET_BYTES`,
each chunk's selection by `topk.launch_topk`, as the ops twin composes the two."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from dsv4cp.kernels.indexer_logits import launch_mqa_logits
from dsv4cp.kernels.indexer_logits_int8 import encode_int8, launch_mqa_logits_int8
from dsv4cp.kernels.topk import launch_topk
from dsv4cp.ops.indexer_topk import in_row_chunks
from dsv4cp.ops.quant import QuantMode


def logits_then_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    k_start: Tensor | None,
    width: int,
    quant: QuantMode,
    key_bits: int = 32,
    packed: bool = True,
    fill: bool = False,
    int8: bool = False,
) -> Tensor:
    """The plain top-k as the ops twin composes it (`ops.indexer_topk.in_row_chunks`, the same
    row chunks), with the kernels: `mqa_logits` (`packed`, `fill` as `launch_mqa_logits`: the
    selection reads only j < n_visible, so by default those past it stay unwritten; `int8`:
    qat's bf16 q and k on int8 MMAs, `indexer_logits_int8`, k encoded once for every chunk),
    then `topk_indices` (its search over `key_bits`: 16 for qat's bf16 scores). int32 [T, k_top]."""
    if int8 and quant == "qat" and q.dtype == torch.bfloat16:
        logits_fn = partial(launch_mqa_logits_int8, k_encoded=encode_int8(k), packed=packed,
                            fill=fill)  # fmt: skip
    else:
        logits_fn = partial(launch_mqa_logits, packed=packed, fill=fill)
    (out,) = in_row_chunks(
        q, weights, k, n_visible, k_start, width,
        lambda logits, rows: [launch_topk(logits, n_visible[rows], k_top, key_bits=key_bits)],
        quant, logits_fn=logits_fn,
    )  # fmt: skip
    return out
