"""Linear layers over the checkpoint's storage formats, with the reference GEMM numerics (torch).

Weights stay as the release stores them (docs/quantization.md):
- fp8: float8_e4m3fn [N, K] + a ue8m0 scale per 32×32 block, [ceil(N/32), ceil(K/32)];
- fp4: two e2m1 codes per byte [N, K/2] (int8 / uint8 / float4_e2m1fn_x2, even element in the low
  nibble) + a ue8m0 scale per row and 32 inputs, [N, K/32];
- dense: bf16 / fp32 [N, K].

quant="qat" is the reference's `linear()` (DeepSeek-V4.1 `inference/model.py`): the activation is
quantized fp8 e4m3 per 32 with power-of-two scales (`act_quant_fp8`), then each 32-wide K block's
partial product is taken in fp32 and the scaled partials are added in K order (kernel_cpu.py
`fp8_gemm` / `fp4_gemm` / `_block_scaled_gemm`). Our block partial is the exact block dot product
(computed in fp64, where 32 fp8×fp8 or fp4×fp8 products sum exactly) rounded once to fp32; the
reference's fp32 matmul may round inside a block, so outputs can differ by a few fp32 ulp
(docs/quantization.md, "GEMM accumulation"). quant="none" dequantizes the weight and runs a plain
F.linear in x.dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.quant import (
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    QuantMode,
    act_quant_fp8,
    check_quant_mode,
    pow2_ceil,
    scale_to_float,
    unpack_fp4,
)

WEIGHT_BLOCK = 32
FP4_WEIGHT_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(
    out_features: int, in_features: int, block: int = WEIGHT_BLOCK
) -> tuple[int, int]:
    """Shape of an fp8 weight's block scale: [ceil(out/block), ceil(in/block)]."""
    return _ceil_div(out_features, block), _ceil_div(in_features, block)


def fp4_scale_shape(
    out_features: int, in_features: int, block: int = WEIGHT_BLOCK
) -> tuple[int, int]:
    """Shape of an fp4 weight's scale: [out, in/block] (in a multiple of block)."""
    if in_features % block:
        raise ValueError(f"fp4 weight: in_features {in_features} is not a multiple of {block}")
    return out_features, in_features // block


def _check_scale(scale: Tensor, expected: tuple[int, int], what: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != expected {expected}")


def check_fp8_blocks(w: Tensor, scale: Tensor, block: int, what: str) -> tuple[int, int]:
    """(N, K) of an fp8 weight [N, K] with its block scales [ceil(N/block), ceil(K/block)]."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"{what}: w must be 2-D float8_e4m3fn, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    _check_scale(scale, fp8_scale_shape(n, k, block), what)
    return n, k


def dequant_fp8_blocks(
    w: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """fp8 weight [N, K] with block scales [ceil(N/block), ceil(K/block)] -> out_dtype [N, K]
    (exact in fp32 and bf16)."""
    n, k = check_fp8_blocks(w, scale, block, "dequant_fp8_blocks")
    s = scale_to_float(scale).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.float() * s).to(out_dtype)


def quantize_fp8_blocks(w: Tensor, block: int = WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """A dense weight [N, K] -> (float8_e4m3fn codes [N, K], float8_e8m0fnu scales
    [ceil(N/block), ceil(K/block)]): per block, scale 2^⌈log2(max(amax, 1e-4)/448)⌉ and codes
    rounded to nearest even. The storage of the release's fp8 weights, for random quantized
    weights (tests, random models); `dequant_fp8_blocks` inverts it up to the e4m3 rounding."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_blocks: w must be a 2-D float tensor, got {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = fp8_scale_shape(n, k, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = codes.view(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return codes, scale.to(torch.float8_e8m0fnu)


def dequant_fp8_rows(values: Tensor, scale: Tensor, block: int = WEIGHT_BLOCK) -> Tensor:
    """fp8 rows [..., D] with a scale per row and `block` channels [..., D/block] -> fp32 [..., D]
    (exact); the Engram tables' layout (reference `ParallelEngramEmbedding.forward`, which then
    rounds to bf16)."""
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequant_fp8_rows: values must be float8_e4m3fn, got {values.dtype}")
    expected = (*values.shape[:-1], values.shape[-1] // block)
    if values.shape[-1] % block or tuple(scale.shape) != expected:
        raise ValueError(
            f"dequant_fp8_rows: scale shape {tuple(scale.shape)} != expected {expected} "
            f"for values {tuple(values.shape)}"
        )
    rows = values.float().unflatten(-1, (-1, block)) * scale_to_float(scale).unsqueeze(-1)
    return rows.flatten(-2)


def check_fp4_weight(packed: Tensor, scale: Tensor, block: int = WEIGHT_BLOCK) -> tuple[int, int]:
    """(N, K) of a packed fp4 weight [N, K/2] with scales [N, K/block]; a ValueError otherwise."""
    if packed.dtype not in FP4_WEIGHT_DTYPES or packed.dim() != 2:
        raise ValueError(
            f"dequant_fp4: packed must be 2-D int8/uint8/float4_e2m1fn_x2, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    n, k = packed.shape[0], 2 * packed.shape[1]
    _check_scale(scale, fp4_scale_shape(n, k, block), "dequant_fp4")
    return n, k


def dequant_fp4(
    packed: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Packed fp4 weight [N, K/2] with scales [N, K/block] -> out_dtype [N, K] (exact in fp32 and
    bf16). Kernel twin: `kernels.fp4_dequant.dequant_fp4` (routed: `routing.dequant_fp4`)."""
    check_fp4_weight(packed, scale, block)
    return (unpack_fp4(packed) * scale_to_float(scale).repeat_interleave(block, 1)).to(out_dtype)


def _block_scaled_matmul(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, block: int
) -> Tensor:
    """Σ_kb (a_kb · b_kbᵀ) · a_scale[:, kb] · b_scale[:, kb], the scaled block partials added in K
    order in fp32; each block partial is the exact dot (fp64) rounded to fp32.

    a [M, K] and b [N, K] hold fp8/fp4 code values, a_scale [M, K/block], b_scale [N, K/block].
    """
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    a64, b64 = a.double(), b.double()
    for kb in range(a.shape[1] // block):
        cols = slice(kb * block, (kb + 1) * block)
        partial = (a64[:, cols] @ b64[:, cols].t()).float()
        acc = acc + partial * a_scale[:, kb : kb + 1] * b_scale[:, kb].unsqueeze(0)
    return acc


def _quantized_act(x: Tensor, k: int, what: str) -> tuple[Tensor, Tensor]:
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x last dim {x.shape[-1]} != weight in_features {k}")
    codes, scale = act_quant_fp8(x.reshape(-1, k), WEIGHT_BLOCK)
    return codes.float(), scale


def fp8_linear(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    rows_valid: Tensor | None = None,
    dense: Tensor | None = None,
) -> Tensor:
    """Reference `linear()` for an F8_E4M3 weight: x [..., K] -> [..., N] in out_dtype (default
    x.dtype); act_quant_fp8(x, 32), then the block-scaled GEMM with fp32 accumulation.
    `rows_valid` (bool, x.shape[:-1]): the rows where it is False are zeroed first (padding
    rows, docs/invariants.md invariant 5). `dense`: the weight already dequantized to bf16
    (`layers.linear.Linear.keep_dequantized`), which the kernel's cuBLAS route multiplies by
    instead of dequantizing per call; checked here, not read (the block sums read the codes)."""
    n, k = check_fp8_blocks(w, w_scale, WEIGHT_BLOCK, "fp8_linear")
    check_dense_weight(dense, n, k)
    x = zero_invalid_rows(x, rows_valid)
    a, a_scale = _quantized_act(x, k, "fp8_linear")
    b_scale = scale_to_float(w_scale).repeat_interleave(WEIGHT_BLOCK, 0)[:n]  # per output row
    y = _block_scaled_matmul(a, a_scale, w.float(), b_scale, WEIGHT_BLOCK)
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def check_dense_weight(dense: Tensor | None, n: int, k: int) -> None:
    """A kept dequantized copy of an fp8 weight [N, K] must be bf16 [N, K] with unit stride."""
    if dense is None:
        return
    if dense.dtype != torch.bfloat16 or tuple(dense.shape) != (n, k) or dense.stride(-1) != 1:
        raise ValueError(
            f"fp8_linear: dense weight must be contiguous bf16 [{n}, {k}], got {dense.dtype} "
            f"{tuple(dense.shape)} stride {tuple(dense.stride())}"
        )


def check_rows_valid(x: Tensor, rows_valid: Tensor | None) -> Tensor | None:
    """rows_valid (bool, x.shape[:-1]) made contiguous, after its shape and dtype are checked."""
    if rows_valid is None:
        return None
    if rows_valid.dtype != torch.bool or tuple(rows_valid.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"rows_valid must be bool {tuple(x.shape[:-1])}, got {rows_valid.dtype} "
            f"{tuple(rows_valid.shape)}"
        )
    return rows_valid.contiguous()


def zero_invalid_rows(x: Tensor, rows_valid: Tensor | None) -> Tensor:
    """x with the rows where `rows_valid` (bool, x.shape[:-1]) is False set to 0 (a new tensor;
    x itself when rows_valid is None)."""
    valid = check_rows_valid(x, rows_valid)
    return x if valid is None else x.masked_fill(~valid[..., None], 0)


def fp4_linear(
    x: Tensor, w_packed: Tensor, w_scale: Tensor, *, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Reference `linear()` for an fp4 expert weight [N, K/2]: x [..., K] -> [..., N] in out_dtype
    (default x.dtype); act_quant_fp8(x, 32) × e2m1 codes, ue8m0 scales per 32, fp32 accumulation."""
    if w_packed.dtype not in FP4_WEIGHT_DTYPES or w_packed.dim() != 2:
        raise ValueError(
            f"fp4_linear: w_packed must be 2-D int8/uint8/float4_e2m1fn_x2, got {w_packed.dtype} "
            f"{tuple(w_packed.shape)}"
        )
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    _check_scale(w_scale, fp4_scale_shape(n, k), "fp4_linear")
    a, a_scale = _quantized_act(x, k, "fp4_linear")
    y = _block_scaled_matmul(
        a, a_scale, unpack_fp4(w_packed), scale_to_float(w_scale), WEIGHT_BLOCK
    )
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    quant: QuantMode,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """y = x · Wᵀ for a weight in checkpoint storage, dispatched on weight.dtype.

    float8_e4m3fn -> fp8 path, int8 / uint8 / float4_e2m1fn_x2 -> packed fp4 path (both need
    `scale`); any other dtype is dense (scale must be None): x is cast to the weight's dtype.
    quant="qat": fp8_linear / fp4_linear; quant="none": the dequantized weight in x.dtype and a
    plain F.linear. The result is in out_dtype (default x.dtype).
    """
    mode = check_quant_mode(quant)
    out_dtype = out_dtype or x.dtype
    quantized = weight.dtype == torch.float8_e4m3fn or weight.dtype in FP4_WEIGHT_DTYPES
    if not quantized:
        if scale is not None:
            raise ValueError(f"linear: a dense {weight.dtype} weight takes no scale")
        return linear_rows(x.to(weight.dtype), weight).to(out_dtype)
    if scale is None:
        raise ValueError(f"linear: a {weight.dtype} weight needs its scale")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if mode == "qat":
        gemm = fp8_linear if fp8 else fp4_linear
        return gemm(x, weight, scale, out_dtype=out_dtype)
    dense = dequant_fp8_blocks(weight, scale) if fp8 else dequant_fp4(weight, scale)
    return linear_rows(x, dense.to(x.dtype)).to(out_dtype)
