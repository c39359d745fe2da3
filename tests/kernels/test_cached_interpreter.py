"""The kernels that read the caches in their storage formats (`sparse_attention_cached`,
`mqa_logits_cached`), on the CPU through Triton's interpreter, against their ops twins.

As in test_interpreter.py, the cases run in one child process started with TRITON_INTERPRET=1
(this file as a script) and report back as JSON. Shapes are small.

- Decoding is exact: with one valid key and no sink, the attention returns that key, so every
  fp8 / fp4 code and scale byte the quantizers can produce is checked bit for bit.
- quant "none": kernel vs twin to fp32 rounding (relative error < 1e-5).
- quant "qat" attention: the kernel's base-2 exponentials round differently from torch.exp, and
  a p that lands near a bf16 rounding midpoint may round the other way: < 1e-4 relative. The
  blocks of 64 run over the concatenated list (16 SWA + 90 compressed indices straddle a block):
  with separate blocks per source the error was ~1e-3 (each block's max sets p's rounding).
- quant "qat" index logits with fp4 keys and fake-fp4 queries: products and sums are exact, so
  bit for bit.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = [
    "attention_decodes_every_code_exactly",
    "attention_matches_twin",
    "attention_bf16",
    "attention_over_a_workspace",
    "logits_match_twin",
    "logits_edges",
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_cached_kernels_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_kernel_limits_name_the_limit() -> None:
    import torch

    from dsv4cp.kernels.attention import check_sparse_attention_cached
    from dsv4cp.kernels.indexer_logits_cached import check_mqa_logits_cached

    q, sink, idx = torch.randn(2, 4, 64), torch.zeros(4), torch.zeros(2, 3, dtype=torch.int32)
    rows = torch.zeros(5, 66, dtype=torch.uint8)
    fp8 = "fp8_ue8m0_32"
    with pytest.raises(ValueError, match=r"swa must be \[N, 66\] \(fp8_ue8m0_32\)"):
        check_sparse_attention_cached(q, rows[:, :64], idx, None, None, sink, fp8, "dense")
    with pytest.raises(ValueError, match=r"comp \(dense\) must be torch.float32"):
        check_sparse_attention_cached(q, rows, idx, rows[:, :64], idx, sink, fp8, "dense")
    with pytest.raises(ValueError, match="comp and comp_indices come together"):
        check_sparse_attention_cached(q, rows, idx, rows, None, sink, fp8, fp8)
    with pytest.raises(ValueError, match="D must be a multiple of 32"):
        check_sparse_attention_cached(torch.randn(2, 4, 48), rows, idx, None, None, sink, fp8, fp8)
    w, nv = torch.zeros(2, 4), torch.ones(2)
    with pytest.raises(ValueError, match="D_I must be a power of two"):
        check_mqa_logits_cached(torch.randn(2, 4, 96), w, rows, torch.arange(5), nv, "dense")
    with pytest.raises(ValueError, match=r"k_cache must be torch.uint8 \[N, 34\]"):
        check_mqa_logits_cached(q, w, rows, torch.arange(5), nv, "fp4_ue8m0_32")


# ------------------------------------------------------------------ the cases (child process only)


def _cases():  # noqa: C901 - one namespace of small check functions
    import torch

    from dsv4cp import ops
    from dsv4cp.kernels.attention import launch_sparse_attention, sparse_attention_cached
    from dsv4cp.kernels.indexer_logits_cached import launch_mqa_logits_cached
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4
    from dsv4cp.ops.kv_format import decode_rows, encode_rows

    def rel(out, ref):
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), fin), "the -inf pattern differs"
        den = ref[fin].double().norm().clamp_min(1e-30)
        return ((out[fin].double() - ref[fin].double()).norm() / den).item()

    def every_code_rows(fmt, d):
        """Rows whose codes and scale bytes cover what the format can hold."""
        g = torch.Generator().manual_seed(0)
        rows = encode_rows(torch.randn(8, d, generator=g), fmt, dense_dtype=torch.float32)
        n_code = {"fp8_ue8m0_32": d, "fp4_e4m3_16": d // 2, "fp4_ue8m0_32": d // 2}[fmt]
        n = 160  # ≥ 147 scale bytes per format; codes: 160·n_code ≥ 256
        rows = rows[:1].repeat(n, 1)
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[(codes & 0x7F) != 0x7F] if fmt == "fp8_ue8m0_32" else codes
        flat = rows[:, :n_code].reshape(-1)
        flat[: codes.numel()] = codes
        rows[:, :n_code] = flat.view(n, n_code)
        scales = rows[:, n_code:]
        if fmt == "fp4_e4m3_16":  # e4m3 scales from the smallest subnormal to 448
            pos = torch.arange(1, 127, dtype=torch.uint8)
        else:  # ue8m0 exponents from 2^-126 (the quantizers' floor) to 2^20
            pos = torch.arange(1, 148, dtype=torch.uint8)
        sf = scales.reshape(-1)
        sf[:] = pos.repeat(sf.numel() // pos.numel() + 1)[: sf.numel()]
        return rows

    def attention_decodes_every_code_exactly():
        h = 4
        for fmt, d in (("fp8_ue8m0_32", 64), ("fp4_e4m3_16", 32), ("fp4_ue8m0_32", 64)):
            rows = every_code_rows(fmt, d)
            n = rows.shape[0]
            q = torch.zeros(n, h, d)  # equal scores: the one valid key gets all the weight
            idx = torch.full((n, 3), -1, dtype=torch.int32)
            idx[:, 1] = torch.arange(n, dtype=torch.int32)
            sink = torch.full((h,), float("-inf"))
            want = decode_rows(rows, fmt, d)
            for quant in ("none", "qat"):
                out = sparse_attention_cached(
                    q, rows, idx, None, None, sink, 1.0, fmt, "dense", quant
                )
                assert torch.equal(out, want[:, None, :].expand(n, h, d)), (fmt, quant)
            out = sparse_attention_cached(q, rows[:1], idx[:, :1], rows, idx, sink, 1.0, fmt, fmt)
            assert torch.equal(out, want[:, None, :].expand(n, h, d)), (fmt, "comp")

    def _inputs(t, h, d, n_swa, n_comp, k_swa, k_comp, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(t, h, d, generator=g)
        swa_v = torch.randn(n_swa, d, generator=g) * 2
        comp_v = torch.randn(n_comp, d, generator=g)
        si = torch.randint(-1, n_swa, (t, k_swa), generator=g, dtype=torch.int32)
        ci = torch.randint(-1, n_comp, (t, k_comp), generator=g, dtype=torch.int32)
        si[0], ci[0] = -1, -1  # a row with no key
        return q, swa_v, comp_v, si, ci, torch.randn(h, generator=g)

    def attention_matches_twin():
        q, swa_v, comp_v, si, ci, sink = _inputs(6, 4, 64, 40, 300, 16, 90, 1)
        combos = (("dense", "dense"), ("fp8_ue8m0_32", "fp4_e4m3_16"), ("fp8_ue8m0_32", "dense"))
        for quant, tol in (("none", 1e-5), ("qat", 1e-4)):
            for sf, cf in combos:
                swa = encode_rows(swa_v, sf, dense_dtype=torch.float32)
                comp = encode_rows(comp_v, cf, dense_dtype=torch.float32)
                args = (q, swa, si, comp, ci, sink, 0.125, sf, cf, quant)
                ref = ops.sparse_attention_cached(*args)
                out = sparse_attention_cached(*args)
                assert torch.all(out[0] == 0) and rel(out, ref) < tol, (
                    quant,
                    sf,
                    cf,
                    rel(out, ref),
                )
                no_comp = (q, swa, si, None, None, sink, 0.125, sf, cf, quant)
                r = rel(sparse_attention_cached(*no_comp), ops.sparse_attention_cached(*no_comp))
                assert r < tol, (quant, sf, "no comp", r)
        # one index in a list: the launcher appends a skipped -1 where a count of 1 would be a
        # one-trip loop's (`no_count_of_one`); both numerics, with and without compressed keys
        for k_swa, k_comp in ((1, 1), (1, 90), (16, 1)):
            q1, swa_v1, comp_v1, si1, ci1, sink1 = _inputs(5, 4, 64, 40, 300, k_swa, k_comp, 5)
            swa = encode_rows(swa_v1, "fp8_ue8m0_32", dense_dtype=torch.float32)
            comp = encode_rows(comp_v1, "fp4_e4m3_16", dense_dtype=torch.float32)
            for quant, tol in (("none", 1e-5), ("qat", 1e-4)):
                for c, c_idx in ((comp, ci1), (None, None)):
                    args = (q1, swa, si1, c, c_idx, sink1, 0.125, "fp8_ue8m0_32", "fp4_e4m3_16",
                            quant)  # fmt: skip
                    r = rel(sparse_attention_cached(*args), ops.sparse_attention_cached(*args))
                    assert r < tol, (k_swa, k_comp, quant, c is not None, r)
        # dense caches, none: the cached kernel is the dense kernel over [window | top-k]
        swa = encode_rows(swa_v, "dense", dense_dtype=torch.float32)
        both = torch.cat([swa, encode_rows(comp_v, "dense", dense_dtype=torch.float32)])
        idx = torch.cat([si, torch.where(ci >= 0, ci + 40, -1)], 1)
        out = sparse_attention_cached(q, swa, si, both[40:], ci, sink, 0.125)
        assert rel(out, launch_sparse_attention(q, both, idx, sink, 0.125)) < 1e-5

    def attention_bf16():
        q, swa_v, comp_v, si, ci, sink = _inputs(4, 4, 64, 30, 50, 16, 20, 2)
        q = q.bfloat16()
        swa = encode_rows(swa_v, "fp8_ue8m0_32", dense_dtype=torch.bfloat16)
        comp = encode_rows(comp_v, "fp4_e4m3_16", dense_dtype=torch.bfloat16)
        for quant in ("none", "qat"):
            args = (q, swa, si, comp, ci, sink, 0.125, "fp8_ue8m0_32", "fp4_e4m3_16", quant)
            out = sparse_attention_cached(*args)
            assert out.dtype == torch.bfloat16
            assert rel(out.float(), ops.sparse_attention_cached(*args).float()) < 1e-2, quant

    def attention_over_a_workspace():
        """The routed call where neither FlashMLA nor Gluon runs (H = 4): the cached kernel's
        math over the workspace's decoded rows gives the cached kernel's result exactly, in
        both numerics, in one call or in chunks."""
        from unittest import mock

        from dsv4cp.kernels import attention_workspace, flashmla

        q, swa_v, comp_v, si, ci, sink = _inputs(6, 4, 64, 40, 300, 16, 90, 6)
        swa = encode_rows(swa_v, "fp8_ue8m0_32", dense_dtype=torch.float32)
        comp = encode_rows(comp_v, "fp4_e4m3_16", dense_dtype=torch.float32)
        assert flashmla.sparse_attention_cached_backend(q).startswith(
            flashmla.TRITON_OVER_WORKSPACE
        )
        for quant in ("none", "qat"):
            for c, c_idx in ((comp, ci), (None, None)):
                args = (q, swa, si, c, c_idx, sink, 0.125, "fp8_ue8m0_32", "fp4_e4m3_16", quant)
                want = sparse_attention_cached(*args)
                assert torch.equal(flashmla.sparse_attention_cached(*args), want), quant
                with mock.patch.multiple(
                    attention_workspace, WORKSPACE_BUDGET_BYTES=1, MIN_CHUNK_ROWS=2
                ):
                    out = flashmla.sparse_attention_cached(*args)
                assert torch.equal(out, want), (quant, "chunks")

    def logits_match_twin():
        g = torch.Generator().manual_seed(3)
        t, h, d = 37, 4, 64
        q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
        keys = torch.randn(200, d, generator=g)
        rows = torch.randperm(200, generator=g)[:90]
        nv = torch.randint(0, 60, (t,), generator=g)
        ks = torch.cat([torch.zeros(20, dtype=torch.long), torch.full((17,), 30)])
        for fmt in ("dense", "fp4_ue8m0_32"):
            cache = encode_rows(keys, fmt, dense_dtype=torch.float32)
            for k_start, width in ((None, None), (ks, 60)):
                kw = dict(k_start=k_start, width=width, k_format=fmt)
                ref = ops.mqa_logits_cached(q, w, cache, rows, nv, **kw)
                out = launch_mqa_logits_cached(q, w, cache, rows, nv, config=(16, 16, 4, 1), **kw)
                assert rel(out, ref) < 1e-5, (fmt, k_start is not None)
        cache = encode_rows(keys, "fp4_ue8m0_32", dense_dtype=torch.float32)
        qq = fake_quant_index_fp4(q)
        for k_start, width in ((None, None), (ks, 60)):
            kw = dict(k_start=k_start, width=width, k_format="fp4_ue8m0_32", quant="qat")
            ref = ops.mqa_logits_cached(qq, w, cache, rows, nv, **kw)
            out = launch_mqa_logits_cached(qq, w, cache, rows, nv, config=(16, 16, 4, 1), **kw)
            assert torch.equal(out, ref), ("qat", k_start is not None)

    def logits_edges():
        g = torch.Generator().manual_seed(4)
        q, w = torch.randn(1, 3, 32, generator=g), torch.randn(1, 3, generator=g)
        cache = encode_rows(
            torch.randn(5, 32, generator=g), "fp4_ue8m0_32", dense_dtype=torch.float32
        )
        nv = torch.tensor([0])
        out = launch_mqa_logits_cached(q, w, cache, torch.arange(5), nv, k_format="fp4_ue8m0_32")
        assert torch.all(out == float("-inf"))
        empty = launch_mqa_logits_cached(
            q, w, cache, torch.arange(0), nv, width=4, k_format="fp4_ue8m0_32"
        )
        assert empty.shape == (1, 4) and torch.all(empty == float("-inf"))

    return {name: f for name, f in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
