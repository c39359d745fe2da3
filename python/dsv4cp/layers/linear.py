"""`Linear`: a weight held exactly as the released checkpoint stores it, applied with
`dsv4cp.ops.linear.linear` (reference numerics under quant="qat"); an fp8 weight under "qat" goes
through `dsv4cp.routing.fp8_linear` (the Triton GEMM on CUDA). `keep_dequantized_weights` holds
bf16 copies of a module's fp8 weights for the cuBLAS route (memory for time)."""

from __future__ import annotations

from typing import Literal, cast, get_args

import torch
from torch import Tensor, nn

from dsv4cp import env_vars
from dsv4cp.ops.linear import (
    WEIGHT_BLOCK,
    dequant_fp8_blocks,
    fp4_scale_shape,
    fp8_scale_shape,
    linear,
    zero_invalid_rows,
)
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.routing import fp8_linear

Storage = Literal["dense", "fp8", "fp4"]
# Which fp8 weights `DeepseekV41Model.keep_dequantized_weights` holds as bf16 copies; the
# checkpoint loader takes the scope from $DSV4CP_KEEP_BF16_WEIGHTS (default "off").
KeptWeights = Literal["off", "attention", "all"]
KEEP_BF16_ENV = "DSV4CP_KEEP_BF16_WEIGHTS"
_UE8M0_ONE = 127  # biased exponent of 2^0


class Linear(nn.Module):
    """y = x · Wᵀ with W in checkpoint storage; no bias.

    storage "dense": `weight` [out, in] in `dtype`, `scale` None.
    storage "fp8": `weight` float8_e4m3fn [out, in], `scale` float8_e8m0fnu
    [ceil(out/32), ceil(in/32)] (a buffer, so the state-dict names match the checkpoint's
    `<name>.weight` / `<name>.scale`).
    storage "fp4": `weight` int8 [out, in/2] (two e2m1 codes per byte, even element low),
    `scale` float8_e8m0fnu [out, in/32].
    `dtype` is the dense weight's dtype, and for fp8 / fp4 the output dtype (the reference's
    default dtype, bf16). Weights start at 0 and scales at 1; load the checkpoint into them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        storage: Storage,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if storage not in get_args(Storage):
            raise ValueError(f"Linear: storage {storage!r} not in {get_args(Storage)}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear: features must be positive, got {in_features}, {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.storage, self.dtype = storage, dtype
        self.scale: Tensor | None
        if storage == "dense":
            weight = torch.zeros(out_features, in_features, dtype=dtype, device=device)
            self.register_buffer("scale", None)
        else:
            if storage == "fp8":
                weight = torch.zeros(out_features, in_features, device=device).to(
                    torch.float8_e4m3fn
                )
                scale_shape = fp8_scale_shape(out_features, in_features, WEIGHT_BLOCK)
            else:
                scale_shape = fp4_scale_shape(out_features, in_features, WEIGHT_BLOCK)
                weight = torch.zeros(
                    out_features, in_features // 2, dtype=torch.int8, device=device
                )
            scale = torch.full(scale_shape, _UE8M0_ONE, dtype=torch.uint8, device=device)
            self.register_buffer("scale", scale.view(torch.float8_e8m0fnu))
        self.weight = nn.Parameter(weight, requires_grad=False)
        # `keep_dequantized`'s bf16 copy (not in the state dict) and the versions it was made at
        self.dense: Tensor | None
        self.register_buffer("dense", None, persistent=False)
        self._dense_version = (-1, -1)

    def forward(
        self, x: Tensor, quant: QuantMode = "qat", rows_valid: Tensor | None = None
    ) -> Tensor:
        """x [..., in] → [..., out]; the rows where `rows_valid` (bool, x.shape[:-1]) is False
        are zeroed first (inside the activation quantization on the fp8 path)."""
        if self.storage == "fp8" and check_quant_mode(quant) == "qat":
            assert self.scale is not None
            return fp8_linear(
                x,
                self.weight,
                self.scale,
                out_dtype=self.dtype,
                rows_valid=rows_valid,
                dense=self._kept(),
            )
        out_dtype = None if self.storage == "dense" else self.dtype
        x = zero_invalid_rows(x, rows_valid)
        return linear(x, self.weight, self.scale, quant, out_dtype=out_dtype)

    def keep_dequantized(self, keep: bool = True) -> int:
        """Hold (keep=True) or drop a bf16 copy of an fp8 weight, dequantized once (exact), so
        the GEMM's cuBLAS route (CUDA, ≥ 512 rows; docs/quantization.md) multiplies by it instead
        of dequantizing the weight on every call. Costs 2 bytes per weight element; saves that
        route's dequantization pass (~0.04 ms for `wq_b` on the H200). Returns the copy's bytes:
        0 for a weight the route never takes (dense or fp4 storage, an output dtype not bf16).
        Written in place later (a load), the weight or scale is copied again on the next call."""
        if not keep or self.storage != "fp8" or self.dtype != torch.bfloat16:
            self.dense, self._dense_version = None, (-1, -1)
            return 0
        self._refresh_dense()
        assert self.dense is not None
        return self.dense.numel() * self.dense.element_size()

    def _refresh_dense(self) -> None:
        assert self.scale is not None
        self.dense = dequant_fp8_blocks(
            self.weight.detach(), self.scale, WEIGHT_BLOCK, out_dtype=torch.bfloat16
        )
        self._dense_version = (self.weight._version, self.scale._version)

    def _kept(self) -> Tensor | None:
        """The kept bf16 copy, made again if the weight or scale changed since (host ints)."""
        if self.dense is None:
            return None
        assert self.scale is not None
        if (self.weight._version, self.scale._version) != self._dense_version:
            self._refresh_dense()
        return self.dense

    def checkpoint_slots(self, prefix: str, rows: slice = slice(None)) -> dict[str, Tensor]:
        """`{prefix}weight` → the weight's rows `rows` (a view; one part of a fused projection
        takes its range) and, when quantized, `{prefix}scale` → the scale rows of those rows:
        fp8's blocks of WEIGHT_BLOCK rows (the range's ends multiples of it), fp4's rows."""
        out = {f"{prefix}weight": self.weight[rows]}
        if self.scale is not None:
            blocks = rows
            if self.storage == "fp8":
                blocks = slice(
                    None if rows.start is None else rows.start // WEIGHT_BLOCK,
                    None if rows.stop is None else rows.stop // WEIGHT_BLOCK,
                )
            out[f"{prefix}scale"] = self.scale[blocks]
        return out

    def extra_repr(self) -> str:
        sizes = f"in={self.in_features}, out={self.out_features}"
        kept = ", kept bf16 copy" if self.dense is not None else ""
        return f"{sizes}, storage={self.storage}, dtype={self.dtype}{kept}"


def keep_dequantized_weights(module: nn.Module, keep: bool = True) -> int:
    """`Linear.keep_dequantized` on every `Linear` under `module`: the bytes of bf16 copies held."""
    return sum(m.keep_dequantized(keep) for m in module.modules() if isinstance(m, Linear))


def kept_weights_scope() -> KeptWeights:
    """$DSV4CP_KEEP_BF16_WEIGHTS: off (default), attention or all; anything else raises."""
    return cast(KeptWeights, env_vars.read(KEEP_BF16_ENV))
