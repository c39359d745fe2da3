"""The layer's cache writers (`swa_key_rows`, `compress_entries`, `store_index_keys`) through
Triton's interpreter against their ops twins, bit for bit: the encoded rows (codes and scale
bytes), the dense and `store_values` rows, the latents and the pair state.

Exactness: the row kernels reproduce the twins' bits in the interpreter (test_interpreter.py),
except the pooling's exp, which may differ in its last fp32 bit. So the ratio-2 cases draw gates
from {−200, 0, 200}: each exp is exp(0) = 1 or underflows to 0, and the pooled value is one of
the pair or their mean, exact in both — which one depends on reading the right partner's gate.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases
from tests.kernels.quant_rows import adversarial_rows

CASES = [
    "swa_key_rows_encoded",
    "compress_entries_ratio2",
    "compress_entries_ratio1",
    "compress_entries_rank_major",
    "store_index_keys_encoded",
    "encoded_adversarial_rows",
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_kv_encode_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


# ------------------------------------------------------------------ the cases (child process only)


def _cases():  # noqa: C901 - one namespace of small check functions
    import torch

    from dsv4cp import ops
    from dsv4cp.kernels import compressor as kc
    from dsv4cp.kernels import swa as ks
    from dsv4cp.kernels.fake_quant import ENCODED_FORMATS as FORMATS
    from dsv4cp.kernels.norm_rope import norm_rope_rows
    from dsv4cp.ops.kv_format import decode_rows, encode_rows, row_width
    from dsv4cp.ops.rope import YarnScaling

    yarn = YarnScaling(16.0, 65536, 32.0, 1.0)
    u8 = torch.uint8

    def same(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if a.dtype == torch.bfloat16:
            a, b = a.view(torch.int16), b.view(torch.int16)
        elif a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), (a != b).sum().item()

    def swa_key_rows_encoded():
        torch.manual_seed(21)
        # D 96 / rope 32: whole fp8 blocks in the tail; D 64 / rope 16: a block straddles it
        for t, d, dr in ((13, 96, 32), (9, 64, 16)):
            x = (torch.randn(t, d) * 3).bfloat16()
            pos = torch.randint(0, 200000, (t,))
            w = torch.randn(d).bfloat16()
            for stored in (u8, torch.bfloat16):
                args = (x, pos, w, 1e-6, dr, 160000.0, yarn, "qat", "fp8_ue8m0_32", stored)
                got = ks.swa_key_rows(*args)
                same(got, ops.swa_key_rows(*args))
            assert got.shape == (t, d) and stored == torch.bfloat16
            enc = ks.swa_key_rows(x, pos, w, 1e-6, dr, 160000.0, yarn, "qat", "fp8_ue8m0_32", u8)
            assert enc.shape == (t, row_width("fp8_ue8m0_32", d))
            same(decode_rows(enc, "fp8_ue8m0_32", d).bfloat16(), got)
            args = (x, pos, w, 1e-6, dr, 10000.0, None, "none", "dense", torch.bfloat16)
            same(ks.swa_key_rows(*args), ops.swa_key_rows(*args))

    def caches(n_rows, d, fmt, stored):
        width = row_width(fmt, d) if stored == u8 else d
        fill = 0x5A if stored == u8 else 7.0
        c = torch.full((n_rows, width), fill, dtype=stored)
        return c, c.clone()

    def gates(shape):
        return torch.tensor([-200.0, 0.0, 200.0])[torch.randint(0, 3, shape)]

    def compress_entries_ratio2():
        torch.manual_seed(22)
        n, d, dr, s = 12, 64, 16, 10
        kv = torch.randn(n, d) * 2
        gate = gates((n, d))
        comp = torch.cat([kv, gate], 1)
        w = torch.randn(d).bfloat16()
        pos = torch.arange(n) * 2 + 100
        # rows 0 and 5 read their partner from state rows 3 and 7; even rows write state rows
        read = torch.full((n,), -1)
        read[0], read[5] = 3, 7
        write = torch.tensor([-1, 1, -1, 2, -1, -1, 4, -1, 5, -1, 6, -1])
        emit = torch.tensor([-1, 0, -1, 4, -1, 2, -1, 5, -1, 7, -1, 1])
        for fmt, stored, dt in (
            ("fp4_e4m3_16", u8, torch.bfloat16),
            ("fp4_e4m3_16", torch.bfloat16, torch.bfloat16),  # store_values
            ("dense", torch.bfloat16, torch.bfloat16),
            ("dense", torch.float32, torch.float32),  # fp32: the norm's sum order shows
        ):
            c1, c2 = caches(9, d, fmt, stored)
            st1 = (torch.randn(s, d) * 2, gates((s, d)))
            st2 = (st1[0].clone(), st1[1].clone())
            args = (read, write, w, 1e-6, dt, pos, emit)
            got = kc.compress_entries(comp, st1, *args, c1, fmt, dr, 1e4, yarn)
            want = ops.compress_entries(comp, st2, *args, c2, fmt, dr, 1e4, yarn)
            if dt == torch.float32:
                assert torch.allclose(got, want, rtol=2**-20, atol=0)
                assert torch.allclose(c1, c2, rtol=2**-19, atol=2**-19)
            else:
                same(got, want)
                same(c1, c2)
            same(st1[0], st2[0])
            same(st1[1], st2[1])
        # the partner matters: reading state row 3 for row 1 changes its entry
        fmt, bf = "fp4_e4m3_16", torch.bfloat16
        out = []
        for partner in (3, -1):
            c, _ = caches(9, d, fmt, u8)
            read[1] = partner
            st = (st2[0].clone(), st2[1].clone())
            kc.compress_entries(comp, st, read, write, w, 1e-6, bf, pos, emit, c, fmt, dr, 1e4)
            out.append(c)
        assert not torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1:], out[1][1:])

    def compress_entries_ratio1():
        torch.manual_seed(23)
        n, d, dr = 9, 96, 32
        kv = torch.randn(n, d).bfloat16()
        w = torch.randn(d)
        pos = torch.arange(n) + 1000
        emit = torch.tensor([3, -1, 0, 5, 8, -1, 1, 2, 4])
        for fmt, stored in (("fp4_e4m3_16", u8), ("dense", torch.bfloat16)):
            c1, c2 = caches(10, d, fmt, stored)
            args = (None, None, None, w, 1e-20, torch.bfloat16, pos, emit)
            got = kc.compress_entries(kv, *args, c1, fmt, dr, 160000.0, yarn)
            same(got, ops.compress_entries(kv, *args, c2, fmt, dr, 160000.0, yarn))
            same(c1, c2)
            assert torch.equal(c1[[6, 7, 9]], c2[[6, 7, 9]])  # rows nobody emits to: untouched

    def compress_entries_rank_major():
        # comp_kv as a CP all-gather leaves it (rank-major, padding rows), read in token order
        # through CPLayout.rerange_index: the rows, latents and pair state of the token-order run
        from dsv4cp.cp.layout import CPLayout

        torch.manual_seed(25)
        lay = CPLayout.build(10, 3)  # P = 4: 12 gathered rows, 2 of them padding
        src = lay.rerange_index
        d, dr, s = 64, 16, 10
        w = torch.randn(d).bfloat16()
        read = torch.full((10,), -1)
        read[0], read[7] = 3, 8
        write = torch.tensor([-1, 1, -1, 2, -1, -1, 4, -1, 5, -1])
        pos = torch.arange(10) * 2 + 100
        emit = torch.tensor([-1, 0, -1, 4, -1, 2, -1, 5, -1, 7])
        comp_tok = torch.cat([torch.randn(10, d) * 2, gates((10, d))], 1)
        gathered = torch.full((12, 2 * d), 1e4)  # padding rows must never be read
        gathered[src] = comp_tok
        fmt = "fp4_e4m3_16"
        state = (torch.randn(s, d) * 2, gates((s, d)))
        runs = []
        for impl, comp, rows in (
            (kc, gathered, src),
            (ops, gathered, src),
            (ops, comp_tok, None),
        ):
            c, _ = caches(9, d, fmt, u8)
            st = (state[0].clone(), state[1].clone())
            args = (read, write, w, 1e-6, torch.bfloat16, pos, emit, c, fmt, dr, 1e4, yarn)
            runs.append((impl.compress_entries(comp, st, *args, src_rows=rows), c, st))
        want_lat, want_c, want_st = runs[2]
        for lat, c, st in runs[:2]:
            same(lat, want_lat)
            same(c, want_c)
            same(st[0], want_st[0])
            same(st[1], want_st[1])
        # ratio 1 (bf16 entries, no pair state)
        kv_tok = torch.randn(10, d).bfloat16()
        g1 = torch.zeros(12, d).bfloat16()
        g1[src] = kv_tok
        emit1 = torch.tensor([3, -1, 0, 5, 8, -1, 1, 2, 4, 6])
        outs = []
        for impl, comp, rows in ((kc, g1, src), (ops, kv_tok, None)):
            c, _ = caches(10, d, fmt, u8)
            args = (None, None, None, w, 1e-20, torch.bfloat16, pos, emit1, c, fmt, dr, 1e4, yarn)
            outs.append((impl.compress_entries(comp, *args, src_rows=rows), c))
        same(outs[0][0], outs[1][0])
        same(outs[0][1], outs[1][1])

    def store_index_keys_encoded():
        torch.manual_seed(24)
        for n, d, dr, di in ((11, 96, 32, 64), (6, 64, 16, 32)):
            lat = torch.randn(n, d).bfloat16()
            pos = torch.arange(n) * 2 + 300
            wk, kn = (torch.randn(di, d) / 8).bfloat16(), torch.randn(di).bfloat16()
            emit = torch.randperm(n + 3)[:n]
            emit[1] = -1
            for fmt, stored in (
                ("fp4_ue8m0_32", u8),
                ("fp4_ue8m0_32", torch.bfloat16),
                ("dense", torch.bfloat16),
            ):
                c1, c2 = caches(n + 3, di, fmt, stored)
                args = (lat, wk, kn, 1e-20, pos, emit)
                kc.store_index_keys(*args, c1, fmt, dr, 160000.0, yarn)
                ops.store_index_keys(*args, c2, fmt, dr, 160000.0, yarn)
                same(c1, c2)

    def encoded_adversarial_rows():
        # zeros (amax floors), tiny blocks, e4m3-scale saturation (amax/6 > 448), exact e2m1
        # midpoints of the scale, -0.0 (code sign bits), subnormal e4m3 codes; RoPE at 0
        d = 64
        lat = adversarial_rows(d)
        pos = torch.zeros(8, dtype=torch.long)
        for quant, fmt in FORMATS.items():
            out = torch.full((8, row_width(fmt, d)), 0x5A, dtype=u8)
            norm_rope_rows(
                lat,
                out,
                positions=pos,
                rope_dim=16,
                theta=1e4,
                yarn=None,
                norm=False,
                fake_quant=quant,
                encode=True,
                round_dtype=torch.bfloat16,
            )
            key = ops.apply_rope(lat, pos, 16, 1e4, None)
            same(out, encode_rows(key, fmt, dense_dtype=torch.bfloat16))
        assert encode_rows(lat, "fp8_ue8m0_32", dense_dtype=torch.bfloat16)[4, 0] == 0x80
        args = (lat, pos, None, 1e-20, 16, 1e4, None, "qat", "fp8_ue8m0_32", u8)
        same(ks.swa_key_rows(*args), ops.swa_key_rows(*args))

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
