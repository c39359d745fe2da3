"""Pure-torch reference ops (CPU and GPU): the ground truth for the kernels."""

from __future__ import annotations

from dsv4cp.ops.attention import sparse_attention, sparse_attention_cached
from dsv4cp.ops.attention_quant import sparse_attention_qat
from dsv4cp.ops.compressor import (
    compress_entries,
    compressed_key,
    compressed_latent,
    index_key,
    pair_pool,
    store_index_keys,
)
from dsv4cp.ops.hyper_connections import hc_collapse, hc_expand, hc_mix_logits, sinkhorn_split
from dsv4cp.ops.indexer import (
    candidate_blocks,
    indexer_weights,
    mqa_logits,
    rope_index_queries,
    topk_among_blocks,
    topk_indices,
)
from dsv4cp.ops.indexer_cached import mqa_logits_cached
from dsv4cp.ops.indexer_topk import (
    mqa_topk,
    mqa_topk_among_blocks,
    mqa_topk_cached,
    mqa_topk_candidates,
)
from dsv4cp.ops.linear import dequant_fp4, fp8_linear
from dsv4cp.ops.matmul import linear_fp32
from dsv4cp.ops.moe_experts import grouped_fp4_mm
from dsv4cp.ops.norm import rms_norm
from dsv4cp.ops.output import grouped_output, grouped_wo_a
from dsv4cp.ops.pool_rows import swa_rows, window_rows
from dsv4cp.ops.quant import QuantMode, check_quant_mode, fake_act_quant_fp8
from dsv4cp.ops.rope import YarnScaling, apply_rope, rope_cos_sin, rope_inv_freq, rope_tail_
from dsv4cp.ops.rowwise import rowwise_linear_fp32
from dsv4cp.ops.swa import store_swa_k, swa_key, swa_key_rows

__all__ = [
    "QuantMode",
    "YarnScaling",
    "apply_rope",
    "candidate_blocks",
    "check_quant_mode",
    "compress_entries",
    "compressed_key",
    "compressed_latent",
    "dequant_fp4",
    "fake_act_quant_fp8",
    "fp8_linear",
    "grouped_fp4_mm",
    "grouped_output",
    "grouped_wo_a",
    "hc_collapse",
    "hc_expand",
    "hc_mix_logits",
    "index_key",
    "indexer_weights",
    "linear_fp32",
    "mqa_logits",
    "mqa_logits_cached",
    "mqa_topk",
    "mqa_topk_among_blocks",
    "mqa_topk_cached",
    "mqa_topk_candidates",
    "pair_pool",
    "rms_norm",
    "rope_cos_sin",
    "rope_index_queries",
    "rope_inv_freq",
    "rope_tail_",
    "rowwise_linear_fp32",
    "sinkhorn_split",
    "sparse_attention",
    "sparse_attention_cached",
    "sparse_attention_qat",
    "store_index_keys",
    "store_swa_k",
    "swa_key",
    "swa_key_rows",
    "swa_rows",
    "topk_among_blocks",
    "topk_indices",
    "window_rows",
]
