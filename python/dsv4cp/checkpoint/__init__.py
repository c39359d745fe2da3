"""Reading DeepSeek-V4.1 released-format checkpoints (HF safetensors shards), lazily and checked."""

from __future__ import annotations

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.checkpoint.formats import expected_dtype, expected_scale_shape, tensor_kind
from dsv4cp.checkpoint.load import load_into
from dsv4cp.checkpoint.reader import CheckpointReader, TensorSpec
from dsv4cp.checkpoint.validate import check_dtype, check_quantized_weight, validate_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "TensorSpec",
    "check_dtype",
    "check_quantized_weight",
    "expected_dtype",
    "expected_scale_shape",
    "load_into",
    "tensor_kind",
    "validate_checkpoint",
]
