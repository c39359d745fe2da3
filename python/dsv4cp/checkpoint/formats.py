"""What each tensor of a released DeepSeek-V4.1 checkpoint must be: storage kind, dtype, and the
shape of a quantized weight's `.scale` (the fixture checkpoint's README.md, "Storage")."""

from __future__ import annotations

import re
from typing import Literal, cast

TensorKind = Literal["fp8", "fp4", "fp8_rows", "scale", "bf16", "f32"]
BLOCK = 32  # weight_block_size [32, 32]; fp4 and Engram scales are per 32 inputs

_LAYER = r"^(layers|mtp)\.\d+\."
_RULES: tuple[tuple[re.Pattern[str], TensorKind], ...] = tuple(
    (re.compile(pattern), cast(TensorKind, kind))
    for pattern, kind in (
        (_LAYER + r"ffn\.experts\.\d+\.w[123]\.weight$", "fp4"),
        (
            _LAYER + r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
            r"|engram\.wkv|main_proj)\.weight$",
            "fp8",
        ),
        (_LAYER + r"engram\.embed\.weight$", "fp8_rows"),
        (_LAYER + r".*\.scale$", "scale"),
        (_LAYER + r"(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$", "f32"),
        (
            _LAYER + r"(attn\.compressor\..*|attn\.indexer\.(wk|weights_proj|k_norm)\.weight"
            r"|ffn\.gate\.weight|(\w+\.)?\w*norm\.weight|engram\.[qk]_weight"
            r"|(markov_head|confidence_head)\..*)$",
            "bf16",
        ),
        (r"^(embed|head|norm)\.weight$", "bf16"),
    )
)
KIND_DTYPE: dict[TensorKind, str] = {
    "fp8": "F8_E4M3",
    "fp4": "I8",
    "fp8_rows": "F8_E4M3",
    "scale": "F8_E8M0",
    "bf16": "BF16",
    "f32": "F32",
}
QUANTIZED_KINDS = ("fp8", "fp4", "fp8_rows")


def tensor_kind(name: str) -> TensorKind | None:
    """The storage kind of a backbone / DSpark tensor; None for names without a rule (vision)."""
    for pattern, kind in _RULES:
        if pattern.search(name):
            return kind
    return None


def expected_dtype(name: str) -> str | None:
    """The safetensors dtype the release stores `name` in, None if there is no rule for it."""
    kind = tensor_kind(name)
    return None if kind is None else KIND_DTYPE[kind]


def scale_name(weight_name: str) -> str:
    """`<module>.weight` -> `<module>.scale`."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a `.weight` tensor")
    return weight_name[: -len("weight")] + "scale"


def expected_scale_shape(kind: TensorKind, weight_shape: tuple[int, ...]) -> tuple[int, int]:
    """fp8: [ceil(out/32), ceil(in/32)]; fp4 (packed [out, in/2]): [out, in/32]; fp8_rows (Engram
    table [rows, dim]): [rows, dim/32]. ValueError if the weight shape cannot have a scale."""
    if len(weight_shape) != 2:
        raise ValueError(f"a {kind} weight is 2-D, got shape {list(weight_shape)}")
    rows, cols = weight_shape
    if kind == "fp8":
        return -(-rows // BLOCK), -(-cols // BLOCK)
    in_features = 2 * cols if kind == "fp4" else cols
    if kind not in ("fp4", "fp8_rows") or in_features % BLOCK:
        raise ValueError(f"a {kind} weight of shape {list(weight_shape)} has no per-{BLOCK} scale")
    return rows, in_features // BLOCK
