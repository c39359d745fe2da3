"""The checkpoint's `quantization_config`: how its weights are stored (fp8 blocks, fp4 experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCALE_FORMATS = ("ue8m0",)
# What the loader reads (checkpoint/formats.py): fp8 weights with one scale per 32×32 block, and
# routed experts packed fp4. Other block sizes, or experts stored like the other weights
# (expert_dtype null), would be read with the wrong scale layout: refused here.
WEIGHT_BLOCK_SIZES = ((32, 32),)
EXPERT_DTYPES = ("fp4",)


@dataclass(frozen=True)
class QuantizationConfig:
    """V4.1's released storage: `F8_E4M3` weights with one power-of-two (ue8m0) scale per
    `weight_block_size` block, routed experts packed fp4 (`expert_dtype`), activations quantized
    on the fly (`activation_scheme` "dynamic")."""

    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        b = self.weight_block_size
        if (
            not isinstance(b, (tuple, list))
            or len(b) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in b)
        ):
            raise ValueError(
                f"quantization_config.weight_block_size: must be two positive integers, got {b!r}"
            )
        object.__setattr__(self, "weight_block_size", tuple(b))
        if tuple(b) not in WEIGHT_BLOCK_SIZES:
            raise ValueError(
                f"quantization_config.weight_block_size: dsv4cp reads fp8 weights with 32×32 "
                f"scale blocks only ([32, 32]), got {list(b)}"
            )
        for name, allowed in (
            ("scale_fmt", SCALE_FORMATS),
            ("expert_dtype", EXPERT_DTYPES),
            ("quant_method", ("fp8",)),
            ("activation_scheme", ("dynamic",)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"quantization_config.{name}: must be one of {allowed}, "
                    f"got {getattr(self, name)!r}"
                )

    @classmethod
    def from_hf(cls, raw: Any) -> QuantizationConfig | None:
        """None when the checkpoint has no `quantization_config` (plain bf16/fp32 weights)."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"quantization_config: must be a dict, got {type(raw).__name__}")
        known = {
            "weight_block_size",
            "scale_fmt",
            "expert_dtype",
            "quant_method",
            "activation_scheme",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"quantization_config: unknown keys {unknown}")
        return cls(**raw)

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.weight_block_size),
            "scale_fmt": self.scale_fmt,
            "expert_dtype": self.expert_dtype,
        }
