"""The quantizers against golden values from DeepSeek's reference kernels, bit for bit.

Golden data: tests/fixtures/quant_golden.safetensors (how it was made: quant_golden.README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv4cp.ops.attention_quant import (
    fake_quant_compressed_key_fp4,
    fake_quant_index_fp4,
    fake_quant_swa_key_fp8,
    quant_compressed_key_fp4,
    quant_index_fp4,
    quant_swa_key_fp8,
)
from dsv4cp.ops.quant import (
    QUANT_MODES,
    act_quant_fp8,
    check_quant_mode,
    e2m1_round,
    e8m0_to_float,
    fake_act_quant_fp8,
    fake_fp4_quant,
    fake_fp4_quant_e4m3_scale,
    fp4_quant,
    fp4_quant_e4m3_scale,
    pack_fp4,
    pow2_ceil,
    unpack_fp4,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "quant_golden.safetensors"
CHECKPOINT = FIXTURES / "dsv41-tiny-reference" / "checkpoint"
CASES = ("adversarial", "allbf16", "random")
# the e2m1 grid by 3-bit magnitude code (OCP MX spec), written out independently of ops.quant
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw storage bits, so that −0 ≠ +0 and NaN = NaN."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(width)


def assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    diff = bits(ours) != bits(ref)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} elements differ"


# golden key -> (quantizer, its fake variant, block, scale storage dtype)
QUANTIZERS = {
    "fp8": (act_quant_fp8, fake_act_quant_fp8, 32, torch.float8_e8m0fnu),
    "fp4": (fp4_quant, fake_fp4_quant, 32, torch.float8_e8m0fnu),
    "fp4e4m3": (fp4_quant_e4m3_scale, fake_fp4_quant_e4m3_scale, 16, torch.float8_e4m3fn),
}


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
@pytest.mark.parametrize("case", CASES)
def test_quantizer_matches_reference(golden: dict[str, torch.Tensor], case: str, kind: str) -> None:
    quantize, fake, block, scale_dtype = QUANTIZERS[kind]
    x, ref = golden[f"{case}.x"], f"{case}.{kind}"
    codes, scale = quantize(x, block)
    assert_bits_equal(codes, golden[f"{ref}.codes" if kind == "fp8" else f"{ref}.packed"])
    assert_bits_equal(scale.to(scale_dtype), golden[f"{ref}.scale"])
    assert torch.equal(scale, golden[f"{ref}.scale"].float())
    assert_bits_equal(fake(x, block), golden[f"{ref}.fake"])


def test_adversarial_cases_reach_the_edges(golden: dict[str, torch.Tensor]) -> None:
    """The adversarial golden rows really exercise the floors, saturation and subnormal scales."""
    x = golden["adversarial.x"].float()
    amax = x.abs().amax(-1)
    fp8_scale = golden["adversarial.fp8.scale"].float()
    assert (amax < 1e-4).any() and (fp8_scale == 2.0**-22).any()  # fp8 floor
    assert (golden["adversarial.fp8.codes"].float().abs() == 448).any()  # saturated codes
    e4m3_scale = golden["adversarial.fp4e4m3.scale"].float()
    assert ((e4m3_scale > 0) & (e4m3_scale < 2.0**-6)).any()  # subnormal e4m3 scales
    assert (e4m3_scale == 2.0**-9).any() and (e4m3_scale == 448).any()  # floor and saturation
    assert (golden["adversarial.fp4.scale"].float() == 2.0**-126).any()  # ue8m0 fp4 floor


def test_scales_are_exact_in_their_storage_format(golden: dict[str, torch.Tensor]) -> None:
    x = golden["random.x"]
    for scale in (act_quant_fp8(x)[1], fp4_quant(x)[1]):
        mant, _ = torch.frexp(scale)
        assert bool((mant == 0.5).all())  # powers of two = ue8m0 values
    scale = fp4_quant_e4m3_scale(x)[1]
    assert torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)


def test_attention_steps_use_the_reference_blocks(golden: dict[str, torch.Tensor]) -> None:
    x = golden["random.x"]  # [64, 512]: one 512-dim key per row
    assert_bits_equal(quant_swa_key_fp8(x)[0], golden["random.fp8.codes"])
    assert_bits_equal(fake_quant_swa_key_fp8(x), golden["random.fp8.fake"])
    assert_bits_equal(quant_compressed_key_fp4(x)[0], golden["random.fp4e4m3.packed"])
    assert_bits_equal(fake_quant_compressed_key_fp4(x), golden["random.fp4e4m3.fake"])
    assert_bits_equal(quant_index_fp4(x)[0], golden["random.fp4.packed"])
    assert_bits_equal(fake_quant_index_fp4(x), golden["random.fp4.fake"])
    assert quant_swa_key_fp8(x)[1].shape == (64, 16)
    assert quant_compressed_key_fp4(x)[1].shape == (64, 32)


def test_fp32_input_is_read_like_bf16(golden: dict[str, torch.Tensor]) -> None:
    x = golden["random.x"]
    assert_bits_equal(act_quant_fp8(x.float())[0], act_quant_fp8(x)[0])
    assert_bits_equal(fp4_quant(x.float())[0], fp4_quant(x)[0])
    assert fake_fp4_quant(x.float()).dtype == torch.float32


def test_unpack_fp4_decodes_every_byte_low_nibble_first() -> None:
    byte = torch.arange(256, dtype=torch.int32)
    expected = torch.tensor(
        [
            [(-1.0 if (c >> 3) else 1.0) * E2M1_GRID[c & 7] for c in (b & 0xF, b >> 4)]
            for b in byte.tolist()
        ]
    )
    packed = byte.to(torch.uint8).view(256, 1)
    assert torch.equal(unpack_fp4(packed), expected)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), expected)
    assert torch.equal(unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), expected)
    assert torch.signbit(unpack_fp4(torch.tensor([[0x08]], dtype=torch.uint8)))[0, 0]  # code 8 = −0


def test_pack_fp4_round_trips_and_rejects_off_grid_values() -> None:
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    assert torch.equal(pack_fp4(unpack_fp4(packed)), packed)
    with pytest.raises(ValueError, match="e2m1"):
        pack_fp4(torch.tensor([0.5, 0.3]))
    with pytest.raises(ValueError, match="e2m1"):
        pack_fp4(torch.tensor([8.0, 0.0]))
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.tensor([0.5, 1.0, 2.0]))


def test_e2m1_round_is_nearest_with_ties_to_the_even_code() -> None:
    grid = torch.tensor(E2M1_GRID)
    v = torch.arange(-2400, 2401) / 400  # correctly rounded: every midpoint is hit exactly
    got = e2m1_round(v)
    dist = (v.abs()[:, None] - grid[None, :]).abs()
    best = dist.min(-1).values
    for i in torch.nonzero((dist == best[:, None]).sum(-1) == 1).flatten().tolist():
        assert got[i].abs() == grid[int(dist[i].argmin())]  # unique nearest
    ties = (dist == best[:, None]).sum(-1) == 2
    assert int(ties.sum()) == 14  # 7 midpoints, both signs
    codes = (got[ties].abs()[:, None] == grid[None, :]).float().argmax(-1)
    assert bool((codes % 2 == 0).all())
    assert torch.equal(torch.signbit(got), torch.signbit(v))


def test_pow2_ceil() -> None:
    v = torch.tensor([1.0, 1.0000001, 0.75, 2.0**-126, 2.0**-130, 3.0e38, 448.0])
    assert pow2_ceil(v).tolist() == [1.0, 2.0, 1.0, 2.0**-126, 2.0**-126, 2.0**127, 512.0]


def test_e8m0_to_float_covers_every_code() -> None:
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(raw)
    assert got[:255].tolist() == [2.0 ** (b - 127) for b in range(255)]
    assert torch.isnan(got[255])
    assert torch.equal(e8m0_to_float(raw.view(torch.float8_e8m0fnu))[:255], got[:255])
    with pytest.raises(ValueError, match="e8m0"):
        e8m0_to_float(torch.zeros(2))


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of block=32"):
        act_quant_fp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="float tensor"):
        fp4_quant(torch.zeros(2, 32, dtype=torch.int32))


def test_check_quant_mode() -> None:
    assert QUANT_MODES == ("none", "qat")
    assert [check_quant_mode(m) for m in QUANT_MODES] == ["none", "qat"]
    with pytest.raises(NotImplementedError, match="sglang_v4_layout"):
        check_quant_mode("sglang_v4_layout")
    with pytest.raises(ValueError, match="'none', 'qat'"):
        check_quant_mode("reference_qat")


def test_fixture_experts_unpack_low_nibble_first() -> None:
    """The checkpoint's I8 expert weights: our unpacking equals a nibble-by-nibble decode."""
    shard = CHECKPOINT / "model-00001-of-00003.safetensors"
    with safe_open(shard, "pt") as f:
        names = [n for n in f.keys() if ".ffn.experts." in n and n.endswith(".weight")]
        assert names
        w = f.get_tensor(names[0])
    assert w.dtype == torch.int8
    values = unpack_fp4(w)
    assert values.shape == (w.shape[0], 2 * w.shape[1])
    byte = w.view(torch.uint8).to(torch.int32)
    table = torch.tensor(E2M1_GRID + tuple(-g for g in E2M1_GRID))
    assert torch.equal(values[:, 0::2], table[byte & 0xF])
    assert torch.equal(values[:, 1::2], table[byte >> 4])
    assert torch.equal(pack_fp4(values), w.view(torch.uint8))
