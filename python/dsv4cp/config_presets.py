"""Preset values of `DeepseekV41Config.tiny()` and `.flash()` (data only), in HF field names.

FLASH is DeepSeek-V4.1-Flash: the attention fields of its HF config
(tests/fixtures/deepseek-v41-flash-config.json) and the MoE, hyper-connection, Engram, DSpark and
vision values of the reference's flat inference/config.json
(tests/fixtures/deepseek-v41-flash-inference-config.json); tests/test_config.py checks both.
"""

from __future__ import annotations

from typing import Any

from dsv4cp.quantization_config import QuantizationConfig
from dsv4cp.rope_scaling import YarnScaling

# Values both presets share.
V41_SHARED: dict[str, Any] = dict(
    rms_norm_eps=1e-20,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0),
    max_position_embeddings=1048576,
)

# attention-math §11.1, V4.1 variant, window 16; MoE, hyper-connections and Engram off.
TINY: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    head_dim=96,
    qk_rope_head_dim=32,
    q_lora_rank=64,
    o_lora_rank=32,
    o_groups=2,
    sliding_window=16,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=8,
    compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3, 5),
    candidate_source_layer_id=3,
    candidate_topk_blocks=3,
    candidate_block_size=4,
    vocab_size=512,
    intermediate_size=256,
)

# TINY plus the rest of a V4.1 block: hyper-connections (4 streams) and a small MoE (8 routed
# experts top-2 + 1 shared, the tiny reference fixture's sizes). No Engram: it needs a tokenizer
# and tables (the fixture checkpoint has them).
TINY_BLOCKS: dict[str, Any] = dict(
    hc_mult=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
)

FLASH: dict[str, Any] = dict(
    hidden_size=5120,
    num_hidden_layers=40,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_lora_rank=1024,
    o_groups=8,
    sliding_window=128,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
    kv_source_layer_ids=(2, 8, 14, 20),
    index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer_id=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    vocab_size=129280,
    intermediate_size=2 * 5120,  # dsv4cp's dense FFN stand-in; the real model uses the MoE
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=6,
    moe_intermediate_size=2304,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    norm_topk_prob=True,  # absent from inference/config.json: the reference's default
    gate_temp=1.0,  # idem
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    engram_layer_ids=(1, 14),
    engram_num_embeddings=(384006168, 384016682),
    engram_max_ngram_size=4,
    engram_vocab_size=16000000,
    engram_n_heads=8,
    engram_head_dim=256,
    engram_pad_token_id=2,
    engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3,
    image_token_id=129264,
    vision_config=dict(
        model_type="deepseek_v41_vision",
        num_hidden_layers=32,
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=2816,
        patch_size=14,
        downsample_ratio=3,
        rope_theta=10000.0,
    ),
    quantization=QuantizationConfig(
        weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4"
    ),
)
