"""Cache storage formats: encode → decode gives the quantizers' fake values bit for bit, the
bytes are the quantizers' codes and scales in the documented layout, and the row sizes are the
ones attention-math §7 states (528 / 288 / 68 B at Flash dims)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.attention_quant import (
    fake_quant_compressed_key_fp4,
    fake_quant_index_fp4,
    fake_quant_swa_key_fp8,
)
from dsv4cp.ops.kv_format import (
    QUANTIZED_FORMATS,
    check_format,
    decode_rows,
    encode_rows,
    row_bytes,
    row_width,
)
from dsv4cp.ops.quant import act_quant_fp8, fp4_quant, fp4_quant_e4m3_scale

FAKE = {
    "fp8_ue8m0_32": fake_quant_swa_key_fp8,
    "fp4_e4m3_16": fake_quant_compressed_key_fp4,
    "fp4_ue8m0_32": fake_quant_index_fp4,
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _inputs(dim: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randn(16, dim, generator=g) * torch.logspace(-6, 3, 16)[:, None]
    adv = torch.zeros(8, dim)
    adv[1] = 448.0
    adv[2, ::2] = -448.0
    adv[3] = 1e-4 * torch.linspace(-1, 1, dim)  # amax at the fp8 floor
    adv[4] = 6 * 2.0**-126 * torch.linspace(-1, 1, dim)  # subnormal-sized fp4 scales
    adv[5] = 6 * 2.0**-9 * torch.linspace(-1, 1, dim)  # the e4m3-scale floor
    adv[6] = torch.tensor([0.25, 0.75, 2.5, 5.0, -0.25, 3.5, 1e30, -1e-30]).repeat(dim // 8)
    adv[7] = -0.0
    return {"random": rnd, "adversarial": adv}


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("dim", [64, 96, 128, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_of_encode_is_the_fake_quantizer(fmt: str, dim: int, dtype: torch.dtype) -> None:
    for name, x in _inputs(dim, dim).items():
        x = x.to(dtype)
        rows = encode_rows(x, fmt, dense_dtype=dtype)
        assert rows.dtype == torch.uint8 and rows.shape == (x.shape[0], row_width(fmt, dim))
        got = decode_rows(rows, fmt, dim)
        want = FAKE[fmt](x).float()
        assert torch.equal(_bits(got), _bits(want)), (name, fmt, dim)
        # the decoded values are exact in bf16 too (kernels feed them to bf16 tensor cores)
        assert torch.equal(got.bfloat16().float(), got), (name, fmt)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0_32", "fp4_ue8m0_32"])
def test_power_of_two_scaled_fake_values_encode_to_the_same_values(fmt: str) -> None:
    """A cache that receives already fake-quantized SWA (or index) keys stores the same values:
    with power-of-two scales the re-quantized scale is the same or half (top code exactly 224,
    resp. 3) and halving it doubles codes exactly."""
    edge = torch.zeros(4, 128)
    edge[0, :3] = torch.tensor([224.2, 0.75, -3e-3])  # fp8: top code 224 → scale halves
    edge[1, :3] = torch.tensor([3.2, 0.75, 0.25])  # fp4: top code 3 → scale halves
    edge[2, :2] = torch.tensor([448.0, 2.0**-9])  # saturated top code, subnormal codes
    edge[3, :2] = torch.tensor([1.0001e-4, 1e-7])  # at the fp8 amax floor
    for x in [*_inputs(128, 3).values(), edge]:
        fake = FAKE[fmt](x.bfloat16())
        again = decode_rows(encode_rows(fake, fmt, dense_dtype=torch.bfloat16), fmt, 128)
        assert torch.equal(again, fake.float())


def test_byte_layout_is_codes_then_scales() -> None:
    x = torch.randn(5, 64)
    rows = encode_rows(x, "fp8_ue8m0_32", dense_dtype=torch.float32)
    codes, scale = act_quant_fp8(x, 32)
    assert torch.equal(rows[:, :64], codes.view(torch.uint8))
    assert torch.equal(rows[:, 64:].long(), torch.log2(scale).long() + 127)  # ue8m0 exponent
    rows = encode_rows(x, "fp4_e4m3_16", dense_dtype=torch.float32)
    packed, scale = fp4_quant_e4m3_scale(x, 16)
    assert torch.equal(rows[:, :32], packed)
    assert torch.equal(rows[:, 32:].view(torch.float8_e4m3fn).float(), scale)
    rows = encode_rows(x, "fp4_ue8m0_32", dense_dtype=torch.float32)
    packed, scale = fp4_quant(x, 32)
    assert torch.equal(rows[:, :32], packed)
    assert torch.equal(rows[:, 32:].long(), torch.log2(scale).long() + 127)


def test_row_sizes_at_flash_dims() -> None:
    assert row_bytes("fp8_ue8m0_32", 512, torch.bfloat16) == 528
    assert row_bytes("fp4_e4m3_16", 512, torch.bfloat16) == 288
    assert row_bytes("fp4_ue8m0_32", 128, torch.bfloat16) == 68
    assert row_bytes("dense", 512, torch.bfloat16) == 1024
    assert row_bytes("dense", 512, torch.float32) == 2048


def test_dense_rows_are_the_values() -> None:
    x = torch.randn(3, 96)
    rows = encode_rows(x, "dense", dense_dtype=torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(
        decode_rows(rows, "dense", 96), rows.float()
    )


def test_bad_formats_and_shapes_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown cache format 'fp6'"):
        check_format("fp6")
    with pytest.raises(ValueError, match="dim 40 must be a positive multiple of 32"):
        row_width("fp8_ue8m0_32", 40)
    with pytest.raises(ValueError, match=r"rows must be uint8 \[n, 68\]"):
        decode_rows(torch.zeros(2, 70, dtype=torch.uint8), "fp4_ue8m0_32", 128)
    with pytest.raises(ValueError, match=r"x must be \[n, dim\]"):
        encode_rows(torch.zeros(2, 3, 64), "fp8_ue8m0_32", dense_dtype=torch.float32)


def test_compressed_key_is_not_idempotent_so_the_cache_takes_it_before_quantization() -> None:
    """Why the layer hands the compressed key to the cache *before* its fake quant: a block
    whose e4m3 scale is subnormal can re-quantize to other values (amax 9.6·2^-9: scale 2^-8,
    top code 4; re-quantized: scale 2^-9, code 8 saturates to 6). The fp8 SWA key and the
    ue8m0 index key do not have this (power-of-two scales), as the test above checks."""
    x = torch.zeros(1, 16)
    x[0, 0] = 9.6 * 2.0**-9
    once = fake_quant_compressed_key_fp4(x)
    assert once[0, 0] == 4 * 2.0**-8
    assert fake_quant_compressed_key_fp4(once)[0, 0] == 6 * 2.0**-9  # not idempotent
    rows = encode_rows(x, "fp4_e4m3_16", dense_dtype=torch.float32)
    assert torch.equal(decode_rows(rows, "fp4_e4m3_16", 16), once)


@pytest.mark.parametrize(
    ("dtype", "width", "offset"),
    [
        (torch.uint8, 528, 0),  # the qat SWA row at Flash dims: 66 int64 per row
        (torch.uint8, 528, 4),  # a view 4 bytes in: int32 elements
        (torch.uint8, 7, 0),  # no wider element divides the row: bytes
        (torch.bfloat16, 512, 0),  # the dense SWA row
        (torch.float32, 3, 1),
    ],
)
def test_store_rows_writes_the_bytes_index_copy_writes(
    dtype: torch.dtype, width: int, offset: int
) -> None:
    from dsv4cp.ops.kv_format import _wide, store_rows_

    g = torch.Generator().manual_seed(width + offset)
    base = torch.randint(0, 255, (40 * width + offset,), generator=g, dtype=torch.uint8)
    if dtype == torch.uint8:
        cache = base[offset:].view(40, width)
    else:
        cache = torch.randn(40 * width + offset, generator=g).to(dtype)[offset:].view(40, width)
    values = torch.randn(9, width, generator=g).to(dtype) if dtype != torch.uint8 else (
        torch.randint(0, 255, (9, width), generator=g, dtype=torch.uint8)
    )  # fmt: skip
    rows = torch.randperm(40, generator=g)[:9]
    want = cache.clone().index_copy_(0, rows, values)
    store_rows_(cache, rows.int(), values)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    if (dtype, offset) == (torch.uint8, 0) and width % 8 == 0:
        assert _wide(cache).dtype == torch.int64
    if (dtype, offset) == (torch.uint8, 4):
        assert _wide(cache).dtype == torch.int32
    with pytest.raises(ValueError, match="do not fit the cache"):
        store_rows_(cache, rows, values[:, :-1])
