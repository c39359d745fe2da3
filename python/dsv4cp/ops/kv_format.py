"""Storage formats of the attention caches: one row per key, codes and scales side by side.

A format names how one key row of `dim` values is stored (attention-math §7, SGLang's
`KVLayout.V41` / `V41_FP4` and its fp4 index-K pool, DeepSeek-V4.1 `inference/model.py`
`Attention._window_kv`, `Attention._compress_kv`, `Indexer.forward` for the quantizers):

| format | the key it stores | row (uint8 unless dense) | bytes at Flash dims |
|---|---|---|---|
| `dense` | any, in the cache dtype | `[dim]` of that dtype | 1024 (bf16, dim 512) |
| `fp8_ue8m0_32` | SWA key: e4m3 codes, a ue8m0 scale per 32 | `[dim + dim/32]` | 528 (dim 512) |
| `fp4_e4m3_16` | compressed key: packed e2m1, e4m3 scale per 16 | `[dim/2 + dim/16]` | 288 (512) |
| `fp4_ue8m0_32` | index key: packed e2m1, ue8m0 scale per 32 | `[dim/2 + dim/32]` | 68 (dim 128) |

`encode_rows` quantizes with the reference's quantizers (`ops.quant`); `decode_rows` returns the
dequantized values in fp32, which equal the quantizer's `fake_*` values exactly (an e4m3 or e2m1
code times its scale is exact in fp32, and in bf16 as well). The fp4 codes are packed as in the
checkpoint (even element in the low nibble). Kernels decode the same bytes on load
(`kernels/attention.py`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from dsv4cp.ops.quant import (
    act_quant_fp8,
    e8m0_to_float,
    fp4_quant,
    fp4_quant_e4m3_scale,
    unpack_fp4,
)

KVFormat = Literal["dense", "fp8_ue8m0_32", "fp4_e4m3_16", "fp4_ue8m0_32"]
KV_FORMATS: tuple[KVFormat, ...] = get_args(KVFormat)
QUANTIZED_FORMATS: tuple[KVFormat, ...] = KV_FORMATS[1:]

# per format: (values per code byte, values per scale byte); dense has neither
_LAYOUT: dict[str, tuple[int, int]] = {
    "fp8_ue8m0_32": (1, 32),
    "fp4_e4m3_16": (2, 16),
    "fp4_ue8m0_32": (2, 32),
}


def check_format(fmt: str) -> KVFormat:
    """`fmt` if it is a known format, else ValueError naming the known ones."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {KV_FORMATS}")
    return fmt


def _check_dim(fmt: str, dim: int) -> None:
    block = _LAYOUT[fmt][1]
    if dim <= 0 or dim % block:
        raise ValueError(f"cache format {fmt}: dim {dim} must be a positive multiple of {block}")


def code_bytes(fmt: str, dim: int) -> int:
    """Bytes of codes in one quantized row (the scales follow them)."""
    _check_dim(check_format(fmt), dim)
    return dim // _LAYOUT[fmt][0]


def row_width(fmt: str, dim: int) -> int:
    """Elements of one stored row: dim for dense, else the row's bytes."""
    if check_format(fmt) == "dense":
        return dim
    per_code, per_scale = _LAYOUT[fmt]
    _check_dim(fmt, dim)
    return dim // per_code + dim // per_scale


def storage_dtype(fmt: str, dense_dtype: torch.dtype) -> torch.dtype:
    return dense_dtype if check_format(fmt) == "dense" else torch.uint8


def row_bytes(fmt: str, dim: int, dense_dtype: torch.dtype) -> int:
    """Bytes one key row takes in this format."""
    return row_width(fmt, dim) * storage_dtype(fmt, dense_dtype).itemsize


def _e8m0_bits(scale: Tensor) -> Tensor:
    """fp32 powers of two (normal) -> their ue8m0 byte (the fp32 exponent field)."""
    return ((scale.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def encode_rows(x: Tensor, fmt: str, *, dense_dtype: torch.dtype) -> Tensor:
    """Key rows x [n, dim] → stored rows [n, row_width] (dense: x in dense_dtype)."""
    if check_format(fmt) == "dense":
        return x.to(dense_dtype)
    if x.dim() != 2:
        raise ValueError(f"encode_rows: x must be [n, dim], got {tuple(x.shape)}")
    _check_dim(fmt, x.shape[1])
    if fmt == "fp8_ue8m0_32":
        codes, scale = act_quant_fp8(x, 32)
        return torch.cat([codes.view(torch.uint8), _e8m0_bits(scale)], dim=1)
    if fmt == "fp4_e4m3_16":
        packed, scale = fp4_quant_e4m3_scale(x, 16)
        return torch.cat([packed, scale.to(torch.float8_e4m3fn).view(torch.uint8)], dim=1)
    packed, scale = fp4_quant(x, 32)
    return torch.cat([packed, _e8m0_bits(scale)], dim=1)


def stored_rows(x: Tensor, fmt: str, stored_dtype: torch.dtype) -> Tensor:
    """Key rows x [n, dim] as a cache of numerics `fmt` whose tensor has `stored_dtype` keeps
    them: uint8 → the encoded rows; another dtype → the dequantized values (x itself for dense)
    in that dtype (`store_values` caches, docs/caches.md)."""
    if stored_dtype == torch.uint8 and check_format(fmt) != "dense":
        return encode_rows(x, fmt, dense_dtype=stored_dtype)
    if fmt == "dense":
        return x.to(stored_dtype)
    return decode_rows(encode_rows(x, fmt, dense_dtype=stored_dtype), fmt, x.shape[-1]).to(
        stored_dtype
    )


def decode_rows(rows: Tensor, fmt: str, dim: int) -> Tensor:
    """Stored rows [n, row_width] → fp32 key values [n, dim] (the dequantized keys)."""
    if check_format(fmt) == "dense":
        return rows.float()
    width = row_width(fmt, dim)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != width:
        raise ValueError(
            f"decode_rows {fmt}: rows must be uint8 [n, {width}], got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    n_code = code_bytes(fmt, dim)
    codes, scale_bytes = rows[:, :n_code], rows[:, n_code:]
    block = _LAYOUT[fmt][1]
    if fmt == "fp8_ue8m0_32":
        values = codes.view(torch.float8_e4m3fn).float()
    else:
        values = unpack_fp4(codes)
    if fmt == "fp4_e4m3_16":
        scale = scale_bytes.view(torch.float8_e4m3fn).float()
    else:
        scale = e8m0_to_float(scale_bytes)
    return (values.unflatten(1, (-1, block)) * scale[:, :, None]).flatten(1)


def _wide(x: Tensor) -> Tensor:
    """x [N, W] viewed with the widest of int64 / int32 / int16 elements its rows allow (the same
    bytes: row length, row stride, offset and address all multiples of the element), else x."""
    nbytes = x.element_size()
    if x.dim() != 2 or x.stride(1) != 1:
        return x
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if size <= nbytes:
            break
        spans = (x.shape[1] * nbytes, x.stride(0) * nbytes, x.data_ptr())
        if all(v % size == 0 for v in spans):
            return x.view(dtype)
    return x


def store_rows_(cache: Tensor, rows: Tensor, values: Tensor) -> None:
    """cache[rows[i]] = values[i] (cache [N, W], values [T, W] of its dtype, rows int [T]): one
    `index_copy_` over the rows' bytes in the widest elements they allow (a byte row of 528
    bytes is 66 int64 copies, not 528 byte copies). The same bytes as `index_copy_` itself."""
    if values.dtype != cache.dtype or values.dim() != 2 or values.shape[1:] != cache.shape[1:]:
        raise ValueError(
            f"store_rows_: values {values.dtype} {tuple(values.shape)} do not fit the cache's "
            f"rows {cache.dtype} {tuple(cache.shape)}"
        )
    dst, src = _wide(cache), _wide(values.contiguous())
    if dst.dtype != src.dtype:
        dst, src = cache, values
    dst.index_copy_(0, rows.long(), src)
