"""Triton kernels for the hot ops, with the signatures of their `dsv4cp.ops` twins.

Call these names: each routes a CUDA tensor to its kernel and a CPU tensor to the ops twin
(`DSV4CP_KERNELS=torch` forces ops on CUDA too). The kernel launchers themselves live in the
submodules (mqa_logits, topk, sparse_attention, swa_store, compressor); two of them share a
name with a routed function, so reach a launcher with `from dsv4cp.kernels.mqa_logits import
mqa_logits`, not through the package attribute.
"""

from __future__ import annotations

# Load the submodules first so that the routed functions below, not the modules, end up bound to
# the package attributes `mqa_logits` and `sparse_attention`.
from dsv4cp.kernels import compressor as _compressor  # noqa: F401
from dsv4cp.kernels import mqa_logits as _mqa_logits  # noqa: F401
from dsv4cp.kernels import sparse_attention as _sparse_attention  # noqa: F401
from dsv4cp.kernels import swa_store as _swa_store  # noqa: F401
from dsv4cp.kernels import topk as _topk  # noqa: F401
from dsv4cp.kernels.dispatch import (
    compress_store,
    compressed_key,
    compressed_latent,
    index_key,
    kernel_backend_requested,
    mqa_logits,
    mqa_topk,
    pair_pool,
    sparse_attention,
    store_swa_k,
    swa_key,
    topk_indices,
    use_kernels,
)

__all__ = [
    "compress_store",
    "compressed_key",
    "compressed_latent",
    "index_key",
    "kernel_backend_requested",
    "mqa_logits",
    "mqa_topk",
    "pair_pool",
    "sparse_attention",
    "store_swa_k",
    "swa_key",
    "topk_indices",
    "use_kernels",
]
