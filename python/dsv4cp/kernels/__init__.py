"""Triton kernels for the hot ops, each with the signature of its `dsv4cp.ops` twin.

The layer never calls these directly: `dsv4cp.routing` sends CUDA tensors here and CPU tensors
to `dsv4cp.ops`. Modules: `indexer_logits` (mqa_logits), `topk` (topk_indices), `indexer_topk`
(mqa_topk, mqa_topk_candidates, mqa_topk_among_blocks: the logits fused with their selections;
its kernels in `indexer_topk_scan`, `indexer_topk_merge` and `indexer_topk_gather`, which share
`running_topk` and `index_score`), `indexer_topk_cached` (mqa_topk_cached: the layer's index
node over the index cache, through `indexer_topk`'s launcher), `attention` (the Triton
sparse_attention and sparse_attention_cached), `flashmla` (sparse_attention and
sparse_attention_cached: FlashMLA's sparse prefill where installed and the shape fits — over a
bounded bf16 workspace for the caches, built by `attention_workspace` — else `attention`),
`norm_rope` (the shared fused norm/RoPE row kernel, with `fake_quant` and `precise_math`), `swa`
(swa_key, swa_key_rows, store_swa_k) and `rope` (rope_index_queries, rope_tail_) on it,
`compressor` (pair_pool, compressed_latent, compressed_key, index_key; the layer's fused
writers compress_entries and store_index_keys), `kv_encode` (the jit quantizers and byte
stores that write cache rows as codes + scales from inside `norm_rope`),
`sinkhorn` (sinkhorn_split: mHC's pre / post / Sinkhorn comb in one launch);
`_triton`, `kv_decode` hold what they share. `launch_*` functions take tuning knobs
(benchmarks, tests) on top of the twin's signature.
"""
