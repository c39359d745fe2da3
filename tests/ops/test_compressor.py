"""V4.1 compressor pieces against per-entry loops (attention-math §5.2)."""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from dsv4cp.ops import YarnScaling, compressed_key, compressed_latent, index_key, pair_pool
from tests.host_syncs import HostSyncs

YARN = YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
THETA, D, DR, D_I = 160000.0, 96, 32, 64


def loop_omega(rope_dim: int) -> list[float]:
    def corr(n: float) -> float:
        ratio = YARN.original_max_position / (2 * math.pi * n)
        return rope_dim * math.log(ratio) / (2 * math.log(THETA))

    lo = max(math.floor(corr(YARN.beta_fast)), 0)
    hi = min(math.ceil(corr(YARN.beta_slow)), rope_dim - 1)
    out = []
    for i in range(rope_dim // 2):
        w0 = THETA ** (-2.0 * i / rope_dim)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(w0 / YARN.factor * ramp + w0 * (1.0 - ramp))
    return out


def loop_rope_row(row: list[float], pos: int) -> list[float]:
    k, base = list(row), len(row) - DR
    for i, om in enumerate(loop_omega(DR)):
        z = complex(k[base + 2 * i], k[base + 2 * i + 1]) * cmath.exp(1j * pos * om)
        k[base + 2 * i], k[base + 2 * i + 1] = z.real, z.imag
    return k


def loop_norm_row(row: list[float], weight: list[float], eps: float) -> list[float]:
    inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
    return [v * inv * w for v, w in zip(row, weight, strict=True)]


def loop_pair_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Entry j pools tokens (2j, 2j+1); an odd trailing token emits nothing."""
    kvl, gl = kv.double().tolist(), gate.double().tolist()
    out = []
    for j in range(len(kvl) // 2):
        row = []
        for c in range(kv.shape[1]):
            g0, g1 = gl[2 * j][c], gl[2 * j + 1][c]
            m = max(g0, g1)
            e0, e1 = math.exp(g0 - m), math.exp(g1 - m)
            row.append((e0 * kvl[2 * j][c] + e1 * kvl[2 * j + 1][c]) / (e0 + e1))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(-1, kv.shape[1])


@pytest.mark.parametrize("length", [1, 3, 7, 9, 8], ids=lambda n: f"T{n}")
def test_pair_pool_matches_pair_softmax(length: int) -> None:
    gen = torch.Generator().manual_seed(30)
    kv = torch.randn(length, 8, generator=gen)
    gate = torch.randn(length, 8, generator=gen) * 20
    gate[:, 0] = 0.5  # equal gates: plain average
    gate[0::2, 1] = 1000.0  # even token takes all the weight
    gate[1::2, 2] = 900.0  # odd token takes all the weight
    n = length // 2
    got = pair_pool(kv[1 : 2 * n : 2], gate[1 : 2 * n : 2], kv[0 : 2 * n : 2], gate[0 : 2 * n : 2])
    assert got.dtype == torch.float32 and got.shape == (n, 8)
    want = loop_pair_pool(kv, gate)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    if n:
        assert torch.equal(got[:, 1], kv[0 : 2 * n : 2, 1])
        assert torch.equal(got[:, 2], kv[1 : 2 * n : 2, 2])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=["fp32-latent", "bf16-latent"]
)
@pytest.mark.parametrize("eps", [1e-20, 1e-6], ids=["eps1e-20", "eps1e-6"])
def test_compressed_latent_matches_loop(dtype: torch.dtype, eps: float) -> None:
    gen = torch.Generator().manual_seed(31)
    pooled = torch.randn(5, D, generator=gen) * 4
    weight = torch.randn(D, generator=gen)
    got = compressed_latent(pooled, weight, eps, dtype)
    assert got.dtype == dtype and got.shape == (5, D)
    rounded = pooled.to(dtype).double().tolist()  # L rounds the pooled value first
    want = torch.tensor([loop_norm_row(r, weight.double().tolist(), eps) for r in rounded])
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-7)
    else:
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("ratio", [1, 2], ids=["ratio1", "ratio2"])
def test_compressed_key_ropes_at_entry_position(ratio: int) -> None:
    gen = torch.Generator().manual_seed(32)
    latent = torch.randn(6, D, generator=gen)
    entry_pos = [j * ratio for j in range(6)]
    got = compressed_key(latent, torch.tensor(entry_pos), DR, THETA, YARN)
    want = torch.tensor(
        [loop_rope_row(r, p) for r, p in zip(latent.double().tolist(), entry_pos, strict=True)]
    )
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=2e-6)


def loop_index_key(
    latent: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, eps: float, entry_pos: list[int]
) -> torch.Tensor:
    wkl, kn = wk.double().tolist(), k_norm.double().tolist()
    out = []
    for row, pos in zip(latent.double().tolist(), entry_pos, strict=True):
        proj = [sum(a * b for a, b in zip(row, w_row, strict=True)) for w_row in wkl]
        out.append(loop_rope_row(loop_norm_row(proj, kn, eps), pos))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("ratio", [1, 2], ids=["ratio1", "ratio2"])
@pytest.mark.parametrize("eps", [1e-20, 1e-6], ids=["eps1e-20", "eps1e-6"])
def test_index_key_matches_loop(ratio: int, eps: float) -> None:
    gen = torch.Generator().manual_seed(33)
    latent = torch.randn(7, D, generator=gen)
    wk = torch.randn(D_I, D, generator=gen) / D**0.5
    k_norm = torch.randn(D_I, generator=gen)
    entry_pos = [j * ratio for j in range(7)]
    got = index_key(latent, wk, k_norm, eps, torch.tensor(entry_pos), DR, THETA, YARN)
    assert got.dtype == torch.float32 and got.shape == (7, D_I)
    want = loop_index_key(latent, wk, k_norm, eps, entry_pos)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_index_key_bf16_stays_bf16() -> None:
    gen = torch.Generator().manual_seed(34)
    latent = torch.randn(4, D, generator=gen).to(torch.bfloat16)
    wk = (torch.randn(D_I, D, generator=gen) / D**0.5).to(torch.bfloat16)
    k_norm = torch.randn(D_I, generator=gen)
    got = index_key(latent, wk, k_norm, 1e-20, torch.tensor([0, 2, 4, 6]), DR, THETA, YARN)
    assert got.dtype == torch.bfloat16
    want = loop_index_key(latent, wk, k_norm, 1e-20, [0, 2, 4, 6])
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def _entries_args(t: int = 6, d: int = 32) -> dict:
    g = torch.Generator().manual_seed(5)
    return dict(
        comp_kv=torch.randn(t, 2 * d, generator=g),
        pair_state=(torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)),
        read_rows=torch.tensor([2] + [-1] * (t - 1)),
        write_rows=torch.tensor([-1] * (t - 1) + [3]),
        norm_weight=None,
        eps=1e-6,
        dtype=torch.float32,
        entry_positions=torch.arange(t) * 2,
        emit_rows=torch.tensor([0, -1, 1, -1, 2, -1])[:t],
        cache=torch.zeros(4, d),
        fmt="dense",
        rope_dim=16,
        theta=THETA,
    )


def test_compress_entries_pools_with_the_state_or_the_row_above() -> None:
    from dsv4cp.ops import compress_entries

    a = _entries_args()
    d = a["cache"].shape[1]
    kv, gate = a["comp_kv"][:, :d].clone(), a["comp_kv"][:, d:].clone()
    skv, sgate = (s.clone() for s in a["pair_state"])
    latent = compress_entries(**a)
    partner_kv = torch.cat([skv[2:3], kv[:-1]])  # row 0 reads state row 2, then the row above
    partner_gate = torch.cat([sgate[2:3], gate[:-1]])
    pooled = pair_pool(kv, gate, partner_kv, partner_gate)
    want = compressed_latent(pooled, None, 1e-6, torch.float32)
    assert torch.equal(latent, want)
    key = compressed_key(want, a["entry_positions"], 16, THETA)
    assert torch.equal(a["cache"][:3], key[[0, 2, 4]])  # -1 stores nothing
    assert torch.equal(a["cache"][3], torch.zeros(d))
    assert torch.equal(a["pair_state"][0][3], kv[5])  # written after the reads
    assert torch.equal(a["pair_state"][0][2], skv[2])


@pytest.mark.parametrize("impl", ["ops", "kernels"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(read_rows=None), "ratio 2 needs read_rows and write_rows"),
        (dict(write_rows=torch.tensor([-1, 3])), r"read_rows and write_rows must be \[6\]"),
        (dict(comp_kv=torch.zeros(6, 48)), r"comp_kv must be \[T, 64\]"),
        (dict(pair_state=(torch.zeros(4, 32), torch.zeros(5, 32))), "two contiguous"),
        (dict(emit_rows=torch.zeros(5, dtype=torch.long)), r"must be \[6\]"),
        (dict(entry_positions=torch.zeros(7, dtype=torch.long)), r"must be \[6\]"),
        (dict(cache=torch.zeros(4, 32).bfloat16()), "a dense cache must be torch.float32"),
        (dict(src_rows=torch.zeros(6, 1, dtype=torch.long)), "src_rows must be a 1-d"),
        (dict(src_rows=torch.zeros(6)), "src_rows must be a 1-d int32/int64"),
        (dict(src_rows=torch.arange(5)), r"must be \[5\]"),
    ],
)
def test_compress_entries_refuses_rows_that_disagree(impl: str, change: dict, message: str) -> None:
    # The Triton wrapper checks before it launches anything: CPU tensors reach the same errors.
    if impl == "kernels":
        pytest.importorskip("triton")
        from dsv4cp.kernels.compressor import compress_entries
    else:
        from dsv4cp.ops import compress_entries
    with pytest.raises(ValueError, match=message):
        compress_entries(**{**_entries_args(), **change})


@pytest.mark.parametrize(
    "rows",
    [[-1, 0, -1, 2], [-1, -1, -1], [3, -1, 0], [-1], []],
    ids=["row0-after-skips", "none-kept", "first-kept", "one-skip", "empty"],
)
def test_store_at_writes_kept_rows_only(rows: list[int]) -> None:
    # No mask compaction (a host sync): skipped rows write agreeing duplicates instead.
    from dsv4cp.ops.compressor import _store_at

    for dtype in (torch.float32, torch.uint8):
        cache = torch.arange(4 * 3).reshape(4, 3).to(dtype)
        values = (torch.arange(len(rows) * 3).reshape(len(rows), 3) + 100).to(dtype)
        want = cache.clone()
        for i, r in enumerate(rows):
            if r >= 0:
                want[r] = values[i]
        with HostSyncs() as syncs:
            _store_at(cache, torch.tensor(rows, dtype=torch.long), values)
        assert torch.equal(cache, want)
        assert not syncs.ops, syncs.ops


@pytest.mark.parametrize("impl", ["ops", "kernels"])
def test_store_index_keys_refuses_a_dense_cache_of_another_dtype(impl: str) -> None:
    if impl == "kernels":
        pytest.importorskip("triton")
        from dsv4cp.kernels.compressor import store_index_keys
    else:
        from dsv4cp.ops import store_index_keys
    latent = torch.randn(4, 32)
    with pytest.raises(ValueError, match="a dense cache must be torch.float32"):
        store_index_keys(
            latent, torch.randn(16, 32), None, 1e-6, torch.arange(4), torch.arange(4),
            torch.zeros(4, 16).bfloat16(), "dense", 8, THETA,
        )  # fmt: skip
