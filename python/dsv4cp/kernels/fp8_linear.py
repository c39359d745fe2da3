"""fp8 activation quantization and the per-32 block-scaled fp8 GEMM (Triton), quant="qat".

Twins: `dsv4cp.ops.quant.act_quant_fp8` and `dsv4cp.ops.linear.fp8_linear` (same signatures;
docs/quantization.md). cuBLAS has no per-32 block scales on Hopper, so the GEMM is ours: one
program owns a BLOCK_M × BLOCK_N fp32 tile and walks K in steps of 32, one quantization block per
step. Each step's fresh partial product is scaled by the activation row's and the weight block's
power-of-two scales and added to the tile in K order, as the reference's kernel (`fp8_gemm`,
DeepSeek-V4.1 `inference/kernel.py`) does.

Numerics against the twin: quantization is bit-exact (the e4m3 rounding is done in fp32 on the
bits, the cast only stores exact values). The k-step multiplies the fp8 values as bf16 (exact)
with fp32 accumulation. Measured on the H200 (2026-12-03): with an fp8 MMA step, this kernel alone
made the tiny fixture's blocks stop matching DeepSeek's reference (1.6 % of a block's tokens
within 2 bf16 ulps, against 98 % with the twin on the same GPU); the suspected cause is Hopper's
reduced fp8 accumulation precision. With the bf16 step the H200's `reference-check` passes
(docs/performance.md §6; the fixture's prompts stay below `CUBLAS_MIN_ROWS`, so its GEMMs run
here).
The scaling (powers of two) and the ordered fp32 accumulation are the same. The tile is written
in fp32 and cast to the output dtype by torch (round to nearest even, also under the CPU
interpreter).

Large bf16 GEMMs (≥ `CUBLAS_MIN_ROWS` rows, bf16 out) go to cuBLAS instead (`dequant_mm`): the
quantized activations as bf16 (codes × power-of-two scale: exact), times the weight dequantized
to bf16 for the call (exact), one bf16 GEMM with fp32 accumulation. The same exact products,
summed in cuBLAS's order instead of K order: the fp32 sums differ by rounding (≤ K·2⁻²⁴·Σ|ab|),
so a bf16 output can sit one rounding away from the Triton kernel's. Measured on the H200
(`benchmarks/fp8_gemm.py`, 16K rows at the attention's shapes): this kernel 114–122 TFLOP/s,
`dequant_mm` 314–745 (2.7–6.3× faster), within one bf16 rounding of it. `DSV4CP_FP8_GEMM=triton`
keeps this kernel for every size, `=cublas` takes cuBLAS for every size. `=gluon` (Hopper) takes
`kernels.fp8_gemm_gluon` where auto takes cuBLAS without a kept bf16 weight (`gluon_mm`: the same
exact products, the weight decoded into registers instead of written to HBM per call; slower
than auto on the H100: docs/performance.md §35).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp import env_vars
from dsv4cp.kernels._triton import e4m3_rne, interpreting, pow2_ceil
from dsv4cp.kernels.fp8_dequant import dequant_fp8_blocks
from dsv4cp.kernels.fp8_gemm_gluon import fp8_gemm_gluon, require_hopper
from dsv4cp.ops.linear import (
    WEIGHT_BLOCK,
    check_dense_weight,
    check_fp8_blocks,
    check_rows_valid,
    zero_invalid_rows,
)
from dsv4cp.ops.quant import scale_to_float

# (BLOCK_M, BLOCK_N, num_warps, num_stages); not tuned yet (no GPU sweep of this kernel so far)
DEFAULT_CONFIG = (64, 128, 4, 3)
_ROWS_PER_QUANT_PROGRAM = 4


@triton.jit
def _act_quant_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    stride_cm,
    stride_sm,
    valid_ptr,
    BLOCK: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
    DEQUANT: tl.constexpr,
    ROW_MASK: tl.constexpr,
):
    # one program: ROWS rows × N_BLOCKS quantization blocks of BLOCK values; DEQUANT stores
    # codes × scale in codes_ptr's dtype (exact in bf16/fp32) and no scales; ROW_MASK reads
    # a byte per row and quantizes a 0 row where it is 0
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = pid_k * (N_BLOCKS * BLOCK) + tl.arange(0, N_BLOCKS * BLOCK)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
    if ROW_MASK:
        keep = tl.load(valid_ptr + rows64, mask=rows < M, other=0) != 0
        x = tl.where(keep[:, None], x, 0.0)
    xb = tl.reshape(x.to(tl.float32), (ROWS, N_BLOCKS, BLOCK))
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 1e-4)  # ops.quant.FP8_AMAX_FLOOR
    scale = pow2_ceil(amax * (1.0 / 448.0))  # fp32(1/448), as ops.quant
    v = tl.minimum(tl.maximum(xb / scale[:, :, None], -448.0), 448.0)
    if DEQUANT:
        vals = tl.reshape(e4m3_rne(v) * scale[:, :, None], (ROWS, N_BLOCKS * BLOCK))
        out = codes_ptr + rows64[:, None] * stride_cm + cols[None, :]
        tl.store(out, vals.to(codes_ptr.dtype.element_ty), mask=ok)
        return
    codes = tl.reshape(e4m3_rne(v), (ROWS, N_BLOCKS * BLOCK))
    tl.store(
        codes_ptr + rows64[:, None] * stride_cm + cols[None, :], codes.to(tl.float8e4nv), mask=ok
    )
    blocks = pid_k * N_BLOCKS + tl.arange(0, N_BLOCKS)
    s_ok = (rows[:, None] < M) & (blocks[None, :] < K // BLOCK)
    tl.store(scale_ptr + rows64[:, None] * stride_sm + blocks[None, :], scale, mask=s_ok)


def act_quant_fp8(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Kernel twin of `ops.quant.act_quant_fp8`: x [..., K] -> (float8_e4m3fn codes [..., K],
    fp32 power-of-two scales [..., K // block]); block a power of two ≥ 16."""
    x2 = _act_rows(x, block, "act_quant_fp8")
    m, k = x2.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, k // block, dtype=torch.float32, device=x.device)
    _launch_act_quant(x2, codes, scale, block, dequant=False)
    return codes.view(*x.shape), scale.view(*x.shape[:-1], k // block)


def fake_act_quant_fp8(
    x: Tensor, block: int = 32, *, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Kernel twin of `ops.quant.fake_act_quant_fp8`: act_quant_fp8's codes × scales in out_dtype
    (default x.dtype; exact in bf16 and fp32), one pass: read x once, write once."""
    return _fake_act_quant(x, block, out_dtype or x.dtype)


def _fake_act_quant(
    x: Tensor, block: int, out_dtype: torch.dtype, rows_valid: Tensor | None = None
) -> Tensor:
    """fake_act_quant_fp8 in out_dtype; rows where `rows_valid` is False come out 0."""
    x2 = _act_rows(x, block, "fake_act_quant_fp8")
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    _launch_act_quant(x2, out, out, block, dequant=True, rows_valid=rows_valid)
    return out.view(x.shape)


def _act_rows(x: Tensor, block: int, name: str) -> Tensor:
    if not x.is_floating_point():
        raise ValueError(f"{name}: x must be a float tensor, got {x.dtype}")
    k = x.shape[-1]
    if block < 16 or block & (block - 1) or k % block:
        raise ValueError(f"{name}: last dim {k} must be a multiple of block={block} (2^n ≥ 16)")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_act_quant(
    x2: Tensor,
    out: Tensor,
    scale: Tensor,
    block: int,
    dequant: bool,
    rows_valid: Tensor | None = None,
) -> None:
    m, k = x2.shape
    n_blocks = 1 << (max(1, min(k // block, 128 // block)).bit_length() - 1)  # a power of two
    grid = (triton.cdiv(m, _ROWS_PER_QUANT_PROGRAM), triton.cdiv(k // block, n_blocks))
    if m:
        _act_quant_kernel[grid](
            x2,
            out,
            scale,
            m,
            k,
            x2.stride(0),
            out.stride(0),
            scale.stride(0),
            x2 if rows_valid is None else rows_valid.reshape(-1).view(torch.uint8),
            BLOCK=block,
            N_BLOCKS=n_blocks,
            ROWS=_ROWS_PER_QUANT_PROGRAM,
            DEQUANT=dequant,
            ROW_MASK=rows_valid is not None,
        )


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn64[:, None] * stride_bn + rk[None, :]
    as_ptrs = as_ptr + rm64 * stride_asm
    bs_ptrs = bs_ptr + (rn64 // BLOCK_K) * stride_bsn  # one weight scale per 32 rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in tl.range(0, K // BLOCK_K, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter: fp32 products of the fp8 values
            partial = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            # fp8 values are exact in bf16, and bf16 products sum in fp32; an fp8 MMA step broke
            # the reference agreement on the H200 (suspected: Hopper's fp8 accumulation), so the
            # k-step runs as a bf16 MMA (module docstring).
            partial = tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), out_dtype=tl.float32)
        sa = tl.load(as_ptrs, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptrs, mask=n_ok, other=0.0)
        acc = acc + partial * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        as_ptrs += 1
        bs_ptrs += 1
    c_ptrs = c_ptr + rm64[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


FP8_GEMM_FLAG = "DSV4CP_FP8_GEMM"
CUBLAS_MIN_ROWS = 512  # below it the weight's per-call dequantization is not paid back


def _gemm_backend(x: Tensor, out_dtype: torch.dtype, kept: bool = False) -> str:
    mode: str = env_vars.read(FP8_GEMM_FLAG)
    if mode in ("triton", "cublas"):
        return mode
    rows = x.numel() // max(x.shape[-1], 1)
    big = rows >= CUBLAS_MIN_ROWS and x.dtype == out_dtype == torch.bfloat16
    if not big or interpreting():
        return "triton"
    return "gluon" if mode == "gluon" and not kept else "cublas"


def fp8_linear(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    rows_valid: Tensor | None = None,
    dense: Tensor | None = None,
) -> Tensor:
    """Kernel twin of `ops.linear.fp8_linear`: x [..., K] -> [..., N] in out_dtype (default
    x.dtype); w float8_e4m3fn [N, K], w_scale [ceil(N/32), ceil(K/32)] (e8m0 or float). Large
    bf16 GEMMs take cuBLAS over exact bf16 operands (module docstring), zeroing the rows where
    `rows_valid` is False inside the activation quantization (no pass of its own); `dense` (the
    weight kept dequantized, bf16 [N, K]) replaces that route's per-call dequantization."""
    backend = _gemm_backend(x, out_dtype or x.dtype, kept=dense is not None)
    if backend == "cublas":
        return dequant_mm(x, w, w_scale, out_dtype=out_dtype, rows_valid=rows_valid, dense=dense)
    if backend == "gluon":
        return gluon_mm(x, w, w_scale, out_dtype=out_dtype, rows_valid=rows_valid)
    if dense is not None:  # checked as on the cuBLAS route, though this kernel reads the codes
        check_dense_weight(dense, *_check_gemm_args(x, w, w_scale))
    x = zero_invalid_rows(x, rows_valid)
    return launch_fp8_linear(x, w, w_scale, out_dtype=out_dtype)


def _check_gemm_args(x: Tensor, w: Tensor, w_scale: Tensor) -> tuple[int, int]:
    n, k = check_fp8_blocks(w, w_scale, WEIGHT_BLOCK, "fp8_linear")
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x last dim {x.shape[-1]} != weight in_features {k}")
    return n, k


def dequant_mm(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    rows_valid: Tensor | None = None,
    dense: Tensor | None = None,
) -> Tensor:
    """fp8_linear through cuBLAS: act_quant_fp8's codes × scales and the weight's codes × block
    scales as exact bf16 operands, one bf16 GEMM (fp32 accumulation in cuBLAS's order). `dense`:
    the weight's codes × block scales kept from an earlier call (else dequantized here)."""
    n, k = _check_gemm_args(x, w, w_scale)
    check_dense_weight(dense, n, k)
    a = quantized_act_bf16(x.reshape(-1, k), check_rows_valid(x, rows_valid))
    out = torch.mm(a, (dense if dense is not None else dequant_weight_bf16(w, w_scale)).t())
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def gluon_mm(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    rows_valid: Tensor | None = None,
) -> Tensor:
    """`dequant_mm`'s exact products through `kernels.fp8_gemm_gluon` (Hopper): the quantized
    activation as bf16 times the fp8 weight decoded in registers, no bf16 weight in HBM."""
    n, k = _check_gemm_args(x, w, w_scale)
    require_hopper(x)
    a = quantized_act_bf16(x.reshape(-1, k), check_rows_valid(x, rows_valid))
    out = fp8_gemm_gluon(a, w, w_scale, out_dtype=out_dtype or x.dtype)
    return out.view(*x.shape[:-1], n)


def quantized_act_bf16(x: Tensor, rows_valid: Tensor | None = None) -> Tensor:
    """x [M, K] → act_quant_fp8's codes × power-of-two scales as bf16 [M, K] (exact), one pass;
    rows where `rows_valid` [M] is False come out 0."""
    return _fake_act_quant(x, WEIGHT_BLOCK, torch.bfloat16, rows_valid)


def dequant_weight_bf16(w: Tensor, w_scale: Tensor) -> Tensor:
    """fp8 weight [N, K] × its 32×32 block scales → bf16 [N, K] (exact), one Triton pass."""
    return dequant_fp8_blocks(w, w_scale, WEIGHT_BLOCK, out_dtype=torch.bfloat16)


def launch_fp8_linear(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """fp8_linear with an explicit (BLOCK_M, BLOCK_N, num_warps, num_stages) (benchmarks)."""
    n, k = _check_gemm_args(x, w, w_scale)
    codes, a_scale = act_quant_fp8(x.reshape(-1, k), WEIGHT_BLOCK)
    m = codes.shape[0]
    w = w if w.stride(-1) == 1 else w.contiguous()
    b_scale = scale_to_float(w_scale).contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n, warps, stages = config or DEFAULT_CONFIG
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _fp8_gemm_kernel[grid](
            codes,
            a_scale,
            w,
            b_scale,
            out,
            m,
            n,
            k,
            codes.stride(0),
            a_scale.stride(0),
            w.stride(0),
            b_scale.stride(0),
            out.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=WEIGHT_BLOCK,
            STAGES=stages,
            UPCAST=interpreting(),
            num_warps=warps,
        )
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], n)
