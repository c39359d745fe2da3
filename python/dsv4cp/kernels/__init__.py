"""Triton kernels for the hot ops, each with the signature of its `dsv4cp.ops` twin.

The layer never calls these directly: `dsv4cp.routing` sends CUDA tensors here and CPU tensors
to `dsv4cp.ops`. Modules: `indexer_logits` (mqa_logits), `topk` (topk_indices), `attention`
(sparse_attention), `norm_rope` (the shared fused norm/RoPE row kernel: swa_key, store_swa_k),
`compressor` (pair_pool, compressed_latent, compressed_key, index_key, the fused
compress_store); `_triton` holds what they share. `launch_*` functions take tuning knobs
(benchmarks, tests) on top of the twin's signature.
"""
