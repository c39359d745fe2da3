"""`init_random_`: deterministic random weights by checkpoint name, in every storage the model holds
(dense float, fp8 32×32 blocks + e8m0 scales, packed fp4 + e8m0 scales per 32 inputs)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from dsv4cp.config import DeepseekV41Config
from dsv4cp.ops.quant import act_quant_fp8, fp4_quant

_BLOCK = 32
_FP4_DTYPES = (torch.int8, torch.uint8)


def _scale_of(name: str) -> str | None:
    return name[: -len("weight")] + "scale" if name.endswith(".weight") else None


def _fp8_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 [N, K] → (float8_e4m3fn [N, K], power-of-two scales [⌈N/32⌉, ⌈K/32⌉]) per 32×32
    block (amax / 448 rounded up to a power of two, as the activation quantizer does)."""
    n, k = w.shape
    nb, kb = -(-n // _BLOCK), -(-k // _BLOCK)
    padded = w.new_zeros(nb * _BLOCK, kb * _BLOCK)
    padded[:n, :k] = w
    blocks = padded.view(nb, _BLOCK, kb, _BLOCK).transpose(1, 2).reshape(nb, kb, _BLOCK * _BLOCK)
    codes, scale = act_quant_fp8(blocks, _BLOCK * _BLOCK)
    codes = codes.view(nb, kb, _BLOCK, _BLOCK).transpose(1, 2).reshape(nb * _BLOCK, kb * _BLOCK)
    return codes[:n, :k], scale.view(nb, kb)


def _draw(
    name: str, t: Tensor, config: DeepseekV41Config, g: torch.Generator, device: torch.device | str
) -> Tensor:
    """A float value for the logical weight behind `name` (fp32, on `device`)."""
    shape = (t.shape[0], 2 * t.shape[1]) if t.dtype in _FP4_DTYPES else tuple(t.shape)
    val = torch.randn(shape, generator=g, device=device)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * val
    if not (name.endswith("attn_sink") or name == "embed.weight"):
        val = val / math.sqrt(shape[-1])
    if name.endswith("indexer.wq_b.weight"):
        h, dim = config.index_n_heads, config.index_head_dim
        v = val.view(h, dim, -1)
        v[1::2] = -v[0::2][: h // 2]
    return val


@torch.no_grad()
def init_random_(
    weights: Mapping[str, Tensor],
    config: DeepseekV41Config,
    seed: int,
    *,
    device: torch.device | str = "cpu",
) -> None:
    """Fill checkpoint-named weights in place, in name order, from one generator on `device`:
    the CPU (default) gives every device the same values; "cuda" is fast at Flash dims (the
    benchmarks). Norms 1 + N(0, 0.01), embedding and sinks N(0, 1), matrices N(0, 1/fan_in).
    Quantized weights (fp8, packed fp4) hold those values quantized; their `.scale` tensors are
    written with them and draw nothing.

    Index head 2m+1's query projection is the negative of head 2m's, so at least one head of
    each pair is active and index scores have no exact-zero ties (attention-math erratum 2).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    scales = {s for n, t in weights.items() if t.dtype.itemsize == 1 and (s := _scale_of(n))}
    for name, t in sorted(weights.items()):
        if name in scales:
            continue
        val = _draw(name, t, config, g, device)
        if t.dtype == torch.float8_e4m3fn:
            codes, scale = _fp8_blocks(val)
        elif t.dtype in _FP4_DTYPES:
            codes, scale = fp4_quant(val, _BLOCK)
        else:
            t.copy_(val.to(t.dtype))
            continue
        scale_name = _scale_of(name)
        if scale_name is None or scale_name not in weights:
            raise ValueError(f"init_random_: quantized weight {name!r} has no {scale_name!r}")
        t.copy_(codes.view(t.dtype))
        weights[scale_name].copy_(scale.to(torch.float8_e8m0fnu))
