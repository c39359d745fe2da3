"""grouped_output against a per-group loop (attention-math §4.7)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops import grouped_output


def loop_grouped_output(o, wo_a, wo_b, groups, round_z=None) -> torch.Tensor:
    t_len, h, d = o.shape
    width, rank = h * d // groups, wo_a.shape[0] // groups
    wa, wb = wo_a.double().tolist(), wo_b.double().tolist()
    out = []
    for t in range(t_len):
        z = []
        for g in range(groups):
            members = range(g * h // groups, (g + 1) * h // groups)
            heads = [o[t, hh].double().tolist() for hh in members]
            x = [v for head in heads for v in head]  # heads of group g, concatenated
            assert len(x) == width
            for r in range(rank):
                z.append(sum(a * b for a, b in zip(wa[g * rank + r], x, strict=True)))
        if round_z is not None:
            z = torch.tensor(z).to(round_z).double().tolist()
        out.append([sum(a * b for a, b in zip(row, z, strict=True)) for row in wb])
    return torch.tensor(out, dtype=torch.float64)


SHAPES = [
    pytest.param(4, 6, 2, 3, 5, id="H4-G2"),
    pytest.param(4, 6, 1, 4, 7, id="G1-one-group"),
    pytest.param(4, 5, 4, 2, 3, id="G-eq-H"),
    pytest.param(8, 4, 2, 6, 9, id="H8-G2"),
]


@pytest.mark.parametrize(("h", "d", "groups", "rank", "hidden"), SHAPES)
def test_grouped_output_matches_loop(h: int, d: int, groups: int, rank: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(60)
    o = torch.randn(3, h, d, generator=gen)
    wo_a = torch.randn(groups * rank, h * d // groups, generator=gen)
    wo_b = torch.randn(hidden, groups * rank, generator=gen)
    got = grouped_output(o, wo_a, wo_b, groups)
    assert got.dtype == torch.float32 and got.shape == (3, hidden)
    want = loop_grouped_output(o, wo_a, wo_b, groups)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_z() -> None:
    gen = torch.Generator().manual_seed(61)
    o = torch.randn(4, 4, 8, generator=gen).to(torch.bfloat16)
    wo_a = torch.randn(2 * 6, 16, generator=gen).to(torch.bfloat16)
    wo_b = torch.randn(5, 2 * 6, generator=gen).to(torch.bfloat16)
    got = grouped_output(o, wo_a, wo_b, 2)
    assert got.dtype == torch.bfloat16
    want = loop_grouped_output(o, wo_a, wo_b, 2, round_z=torch.bfloat16)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=5e-2)


def test_bad_shapes_raise() -> None:
    o = torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match="groups"):
        grouped_output(o, torch.zeros(6, 8), torch.zeros(3, 6), 3)
    with pytest.raises(ValueError, match="wo_a"):
        grouped_output(o, torch.zeros(6, 10), torch.zeros(3, 6), 2)
    with pytest.raises(ValueError, match="wo_b"):
        grouped_output(o, torch.zeros(6, 12), torch.zeros(3, 5), 2)


def test_z_is_rounded_before_wo_b() -> None:
    # z0 = o[0], z1 = o[0] + 2^-12·o[1]; y = z1 - z0 is 2^-12 unless z is rounded to bf16 first
    o = torch.zeros(2, 2, 4, dtype=torch.bfloat16)
    o[:, 0, 0], o[:, 0, 1] = 1.5, 1.0
    wo_a = torch.zeros(2, 8, dtype=torch.bfloat16)
    wo_a[0, 0] = 1.0
    wo_a[1, 0], wo_a[1, 1] = 1.0, 2.0**-12
    wo_b = torch.tensor([[-1.0, 1.0]], dtype=torch.bfloat16)
    assert torch.equal(grouped_output(o, wo_a, wo_b, 1), torch.zeros(2, 1, dtype=torch.bfloat16))
    exact = grouped_output(o.float(), wo_a.float(), wo_b.float(), 1)
    assert torch.equal(exact, torch.full((2, 1), 2.0**-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wo_a_is_the_groups_einsum_bit_for_bit(dtype: torch.dtype) -> None:
    """grouped_wo_a writes one bmm into z's [T, G, R] layout: the einsum's values exactly (the
    same per-group GEMMs; only the permuting copy is gone), t = 0 included. The einsum runs over
    the rows among 40 others: on the CPU grouped_wo_a gives every row that result whatever T
    (ops.matmul.CPU_MIN_ROWS)."""
    from dsv4cp.ops import grouped_wo_a

    gen = torch.Generator().manual_seed(62)
    for t in (0, 1, 37):
        o = torch.randn(t, 8, 16, generator=gen).to(dtype)
        wo_a = torch.randn(4 * 5, 8 * 16 // 4, generator=gen).to(dtype)
        many = torch.cat([o, torch.randn(40, 8, 16, generator=gen).to(dtype)])
        want = torch.einsum("tgc,grc->tgr", many.reshape(-1, 4, 32), wo_a.view(4, 5, 32))
        want = want.flatten(1)[:t]
        got = grouped_wo_a(o, wo_a, 4)
        assert got.shape == (t, 20) and got.is_contiguous()
        assert torch.equal(got, want)
