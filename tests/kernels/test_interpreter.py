"""The Triton kernels on the CPU through Triton's interpreter, against their ops twins.

TRITON_INTERPRET must be set before triton is imported, and a pytest process may already have
imported it (other test files), so the cases run in one child process started with that variable
(this file run as a script). Shapes are small: the interpreter steps every program in Python.

bf16 inputs: the interpreter's bf16 tl.dot is wrong (numpy has no bf16 and the operands are
reinterpreted), so the dot kernels upcast bf16 operands to fp32 there (`UPCAST`), and its
fp32 → bf16 cast truncates, so the kernels round to nearest even on the bits there. With both,
the interpreter reproduces the ops twins to fp32 rounding (dot kernels) or bitwise (row kernels).
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases
from tests.kernels.quant_rows import adversarial_rows

FAST = [
    "mqa_fp32_odd_rows",
    "mqa_bf16",
    "mqa_k_start_mixed",
    "mqa_t1_and_no_visible",
    "topk_in_registers",
    "topk_two_level",
    "topk_key_bits",
    "topk_n_le_k",
    "attention_fp32",
    "attention_bf16_with_invalid",
    "attention_all_invalid_rows",
    "attention_nan_like_the_twin",
    "swa_key_and_store",
    "compressor_ratio2",
    "compressor_ratio1_and_index_key",
    "swa_key_qat",
    "compressed_and_index_key_qat",
    "fake_quant_adversarial_rows",
    "index_queries",
    "mqa_logits_qat",
    "rms_norm_rows",
    "norm_sum_order",
]
SLOW = ["topk_ties_wide", "attention_real_dims"]


def _run_child(cases: list[str]) -> dict[str, str]:
    return run_interpreter_cases(__file__, cases, timeout=600)


@pytest.fixture(scope="module")
def fast_results() -> dict[str, str]:
    return _run_child(FAST)


@pytest.mark.parametrize("case", FAST)
def test_interpreter(case: str, fast_results: dict[str, str]) -> None:
    assert fast_results[case] == "ok", fast_results[case]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_interpreter_slow(case: str) -> None:
    result = _run_child([case])[case]
    assert result == "ok", result


# ------------------------------------------------------------------ the cases (child process only)


def _cases():  # noqa: C901 - one namespace of small check functions
    import torch

    from dsv4cp import ops
    from dsv4cp.kernels.attention import launch_sparse_attention, sparse_attention
    from dsv4cp.kernels.compressor import (
        compressed_key,
        compressed_latent,
        index_key,
        pair_pool,
    )
    from dsv4cp.kernels.indexer_logits import launch_mqa_logits
    from dsv4cp.kernels.norm import rms_norm
    from dsv4cp.kernels.rope import rope_index_queries
    from dsv4cp.kernels.swa import store_swa_k, swa_key
    from dsv4cp.kernels.topk import launch_topk, topk_indices
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4
    from dsv4cp.ops.rope import YarnScaling

    yarn = YarnScaling(16.0, 65536, 32.0, 1.0)

    def rel(out, ref):
        out, ref = out.double(), ref.double()
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), fin), "the -inf pattern differs"
        den = ref[fin].norm().clamp_min(1e-30)
        return ((out[fin] - ref[fin]).norm() / den).item()

    def logits64(q, w, k, nv, ks=None, width=None):
        q, w, k = q.double(), w.double(), k.double()
        t, n = q.shape[0], k.shape[0]
        width = n if width is None else width
        ks = torch.zeros(t, dtype=torch.long) if ks is None else ks.long()
        out = torch.full((t, width), float("-inf"), dtype=torch.float64)
        for r in range(t):
            m = min(int(nv[r]), width)
            rows = k[ks[r] : ks[r] + m]
            out[r, :m] = (torch.relu(q[r] @ rows.t()) * w[r, :, None]).sum(0)
        return out

    def check_topk_valid(sel, logits, nv, k):
        for r in range(logits.shape[0]):
            n = int(nv[r])
            got = sel[r]
            picked = got[got >= 0]
            assert torch.all(got[len(picked) :] == -1), "pads are not last"
            assert len(picked) == min(n, k), "wrong count"
            assert torch.all(picked[1:] > picked[:-1]), "not sorted ascending"
            if n > k and not logits[r, :n].isnan().any():
                chosen = torch.zeros(n, dtype=torch.bool)
                chosen[picked.long()] = True
                row = logits[r, :n]
                assert row[chosen].min() >= row[~chosen].max(), "a larger logit was left out"

    def mqa_fp32_odd_rows():
        torch.manual_seed(1)
        t, h, d, n = 37, 4, 64, 150
        q, w, k = torch.randn(t, h, d), torch.randn(t, h), torch.randn(n, d)
        nv = torch.randint(0, n + 1, (t,))
        nv[:2] = torch.tensor([n, 0])
        out = launch_mqa_logits(q, w, k, nv, config=(16, 32, 4, 1))
        assert rel(out, logits64(q, w, k, nv)) < 1e-5
        assert rel(out, ops.mqa_logits(q, w, k, nv)) < 1e-5

    def mqa_bf16():
        torch.manual_seed(2)
        t, h, d, n = 20, 4, 64, 70
        q = torch.randn(t, h, d).bfloat16()
        w, k = torch.randn(t, h), torch.randn(n, d).bfloat16()
        nv = torch.randint(0, n + 1, (t,))
        out = launch_mqa_logits(q, w, k, nv, width=80, config=(16, 32, 4, 1))
        assert rel(out, ops.mqa_logits(q, w, k, nv, width=80)) < 1e-5

    def mqa_k_start_mixed():
        torch.manual_seed(3)
        t, h, d, n = 21, 4, 64, 120
        q, w, k = torch.randn(t, h, d), torch.randn(t, h), torch.randn(n, d)
        ks = torch.cat([torch.zeros(8, dtype=torch.long), torch.full((13,), 40)])  # 2 requests
        nv = torch.minimum(torch.randint(0, 90, (t,)), n - ks)
        out = launch_mqa_logits(q, w, k, nv, k_start=ks, width=64, config=(16, 32, 4, 1))
        assert rel(out, logits64(q, w, k, nv, ks, 64)) < 1e-5
        assert rel(out, ops.mqa_logits(q, w, k, nv, k_start=ks, width=64)) < 1e-5

    def mqa_t1_and_no_visible():
        torch.manual_seed(4)
        h, d, n = 4, 64, 40
        q, w, k = torch.randn(1, h, d), torch.randn(1, h), torch.randn(n, d)
        out = launch_mqa_logits(q, w, k, torch.tensor([n]), config=(16, 32, 4, 1))
        assert rel(out, logits64(q, w, k, torch.tensor([n]))) < 1e-5
        q, w = torch.randn(5, h, d), torch.randn(5, h)
        out = launch_mqa_logits(q, w, k, torch.zeros(5, dtype=torch.long), config=(16, 32, 4, 1))
        assert torch.all(out == float("-inf"))

    def topk_in_registers():
        torch.manual_seed(5)
        t, w, k = 9, 200, 16
        logits = torch.randn(t, w)
        nv = torch.tensor([200, 17, 16, 0, 1, 150, 199, 64, 33])
        got = topk_indices(logits, nv, k)
        check_topk_valid(got, logits, nv, k)
        assert torch.equal(got, ops.topk_indices(logits, nv, k))

    def topk_two_level():
        torch.manual_seed(6)
        t, w, k = 6, 300, 24
        logits = torch.randn(t, w)
        logits[0, 10:90] = 0.5  # a tie straddling the cut and the chunk edges
        logits[1] = float("-inf")  # visible -inf entries are still candidates
        logits[1, ::7] = torch.randn(43)
        nv = torch.tensor([300, 300, 25, 24, 130, 257])
        want = ops.topk_indices(logits, nv, k)
        # the slots merge at pieces wider and narrower than k (16: a row's pieces all ≤ k);
        # 512: one piece, each row selected by the piece kernel, no merge
        for piece in (64, 16, 32, 512):
            got = launch_topk(logits, nv, k, piece=piece)
            check_topk_valid(got, logits, nv, k)
            assert torch.equal(got, want), piece
        for cap in (None, 32):  # 32: the candidates overflow and the row is searched in memory
            got = launch_topk(logits, nv, k, piece=64, merge="stream", stream=32, cap=cap)
            check_topk_valid(got, logits, nv, k)
            assert torch.equal(got, want)
        for bad, said in (({"piece": 0}, "piece must be a power of two"),
                          ({"piece": 48}, "piece must be a power of two"),
                          ({"merge": "heap"}, "merge must be"),
                          ({"merge": "slots", "cap": 32}, "apply to merge='stream' only"),
                          ({"stream": 32}, "apply to merge='stream' only"),
                          ({"piece": 1, "merge": "slots", "wide": 1100}, "cannot hold"),
                          ):  # fmt: skip
            try:
                wide = bad.pop("wide", 0)  # 1100 pieces of 1 key: slots too many to merge
                x, n = (torch.zeros(1, wide), torch.tensor([wide])) if wide else (logits, nv)
                launch_topk(x, n, k, **{"piece": 64, **bad})
            except ValueError as e:
                assert said in str(e), e
            else:
                raise AssertionError(f"{bad} accepted")

    def topk_key_bits():
        # bf16-valued logits (both signs, heavy ties, ±inf): the 17-step search selects what the
        # 32-step one and the twin select, in registers, two-level and its overflow fallback
        # (key_bits 16 takes the bf16-pair search by default, packed=False the int32 keys'), and
        # a piece holding a NaN falls back to the int32 keys from memory
        torch.manual_seed(8)
        t, w, k = 9, 300, 24
        logits = (torch.randn(t, w) * 3).bfloat16().float()
        logits[0, 10:90] = 0.5
        logits[1] = float("-inf")
        logits[1, ::7] = torch.randn(43).bfloat16().float()
        logits[2, ::5] = float("inf")
        logits[3] = torch.randint(-3, 4, (w,)).float()
        logits[5, ::2], logits[5, 1::2] = 0.0, -0.0  # the cut among ±0: they tie, as in the twin
        logits[5, 100:110] = 1.0
        logits[6, 7] = logits[6, 200] = float("nan")  # NaNs: above +inf (+), below −inf (−)
        logits[6, 50] = -float("nan")
        logits[7] = -logits[7].abs()  # all negative
        logits[8, ::3] = float("-inf")
        nv = torch.tensor([300, 300, 257, 130, 25, 300, 300, 290, 300])
        want = ops.topk_indices(logits, nv, k)
        stream = {"piece": 64, "merge": "stream", "stream": 32}
        for kw in ({}, {"piece": 64}, {"piece": 16}, stream, {**stream, "cap": 32}):
            for bits, packed in ((16, None), (16, False), (32, None)):
                got = launch_topk(logits, nv, k, key_bits=bits, packed=packed, **kw)
                check_topk_valid(got, logits, nv, k)
                assert torch.equal(got, want), (kw, bits, packed)
        xb = logits.bfloat16()  # the same values as bf16 logits (torch's cast makes NaNs −NaN)
        want = ops.topk_indices(xb.float(), nv, k)
        for packed in (None, False):
            got = launch_topk(xb, nv, k, key_bits=16, packed=packed)
            assert torch.equal(got, want), ("bf16", packed)
        for bad, said in (({"key_bits": 8}, "key_bits must be 16 or 32"),
                          ({"key_bits": 31}, "key_bits must be 16 or 32"),
                          ({"packed": True}, "packed needs key_bits=16"),
                          ):  # fmt: skip
            try:
                launch_topk(logits, nv, k, **bad)
            except ValueError as e:
                assert said in str(e), e
            else:
                raise AssertionError(f"{bad} accepted")

    def topk_n_le_k():
        logits = torch.randn(4, 40)
        nv = torch.tensor([0, 1, 7, 8])
        got = topk_indices(logits, nv, 8)
        want = torch.tensor([[-1] * 8, [0] + [-1] * 7, list(range(7)) + [-1], list(range(8))])
        assert torch.equal(got, want.to(torch.int32))

    def topk_ties_wide():
        torch.manual_seed(7)
        t, w, k = 4, 2048, 64
        logits = torch.randint(0, 5, (t, w)).float()  # heavy ties, also ±0
        logits[0, ::3] = -0.0
        nv = torch.tensor([2048, 1000, 65, 2000])
        for kw in ({}, {"piece": 512}, {"piece": 512, "merge": "stream", "stream": 256}):
            got = launch_topk(logits, nv, k, **kw)
            check_topk_valid(got, logits, nv, k)
            assert torch.equal(got, ops.topk_indices(logits, nv, k)), kw

    def attention_ref64(q, kv, idx, sink, scale):
        q, kv = q.double(), kv.double()
        t, h, d = q.shape
        out = torch.zeros(t, h, d, dtype=torch.float64)
        for r in range(t):
            sel = idx[r][idx[r] >= 0].long()
            s = (q[r] @ kv[sel].t()) * scale
            allv = torch.cat([s, sink.double()[:, None]], 1)
            p = torch.softmax(allv, 1)[:, :-1]
            out[r] = p @ kv[sel]
        return out

    def attention_fp32():
        torch.manual_seed(8)
        t, h, d, n, kk = 5, 4, 96, 50, 40
        q, kv = torch.randn(t, h, d), torch.randn(n, d)
        idx = torch.randint(0, n, (t, kk), dtype=torch.int32)
        sink = torch.randn(h)
        for config in ((16, 4, 1), (32, 4, 2)):
            out = launch_sparse_attention(q, kv, idx, sink, d**-0.5, config=config)
            assert rel(out, attention_ref64(q, kv, idx, sink, d**-0.5)) < 1e-5
            assert rel(out, ops.sparse_attention(q, kv, idx, sink, d**-0.5)) < 1e-5

    def attention_bf16_with_invalid():
        torch.manual_seed(9)
        t, h, d, n, kk = 4, 4, 96, 30, 37
        q, kv = torch.randn(t, h, d).bfloat16(), torch.randn(n, d).bfloat16()
        idx = torch.randint(-1, n, (t, kk), dtype=torch.int32)
        sink = torch.randn(h) * 3
        q[0] *= 30  # large logits: the running max moves mid-row
        ref = ops.sparse_attention(q, kv, idx, sink, d**-0.5)
        for config in ((16, 4, 1),):
            out = launch_sparse_attention(q, kv, idx, sink, d**-0.5, config=config)
            assert out.dtype == torch.bfloat16
            assert rel(out, ref) < 1e-2  # p is rounded to bf16 before p·v, as on the GPU

    def attention_all_invalid_rows():
        torch.manual_seed(10)
        t, h, d, n, kk = 3, 4, 32, 10, 16
        q, kv = torch.randn(t, h, d), torch.randn(n, d)
        idx = torch.full((t, kk), -1, dtype=torch.int32)
        idx[1, 3] = 4  # only the window key
        sink = torch.randn(h)
        out = launch_sparse_attention(q, kv, idx, sink, 0.1, config=(16, 4, 1))
        assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
        assert rel(out, ops.sparse_attention(q, kv, idx, sink, 0.1)) < 1e-5
        sink_off = torch.full((h,), float("-inf"))
        out = launch_sparse_attention(q, kv, idx, sink_off, 0.1, config=(16, 4, 1))
        assert torch.all(out[0] == 0)
        assert torch.allclose(out[1], kv[4].expand(h, d))

    def attention_nan_like_the_twin():
        torch.manual_seed(12)
        t, h, d, n = 6, 4, 32, 20
        q, kv, sink = torch.randn(t, h, d), torch.randn(n, d), torch.randn(h)
        idx = torch.randint(0, n, (t, 9))
        idx[3] = -1  # no visible key: 0 (finite sink)
        q[0, 2, 5] = float("nan")
        kv[int(idx[4, 0])] = float("nan")  # every token that sees this key: all heads
        ref = ops.sparse_attention(q, kv, idx, sink, 0.2)
        out = launch_sparse_attention(q, kv, idx, sink, 0.2, config=(16, 4, 1))
        assert torch.equal(out.isnan(), ref.isnan()) and bool(ref.isnan().any())
        fin = ~ref.isnan()
        assert rel(out[fin], ref[fin]) < 1e-5 and torch.equal(out[3], torch.zeros(h, d))

    def attention_real_dims():
        torch.manual_seed(11)
        t, h, d, n, kk = 2, 64, 512, 300, 200
        q, kv = torch.randn(t, h, d).bfloat16(), torch.randn(n, d).bfloat16()
        idx = torch.randint(-1, n, (t, kk), dtype=torch.int32)
        sink = torch.randn(h)
        out = sparse_attention(q, kv, idx, sink, d**-0.5)
        assert rel(out, ops.sparse_attention(q, kv, idx, sink, d**-0.5)) < 1e-2

    def swa_key_and_store():
        torch.manual_seed(12)
        t, d, dr = 13, 96, 32
        x = torch.randn(t, d).bfloat16()
        pos = torch.randint(0, 200000, (t,))
        w = torch.randn(d)
        for y, theta in ((None, 10000.0), (yarn, 160000.0)):
            got = swa_key(x, pos, w, 1e-6, dr, theta, y, torch.bfloat16)
            assert torch.equal(got, ops.swa_key(x, pos, w, 1e-6, dr, theta, y, torch.bfloat16))
        got = swa_key(x, pos, None, 1e-6, dr, 10000.0, None, torch.float32)
        want = ops.swa_key(x, pos, None, 1e-6, dr, 10000.0, None, torch.float32)
        assert (got - want).abs().max() < 1e-5
        slots = torch.randperm(40)[:t]
        c1 = torch.full((40, d), 7.0, dtype=torch.bfloat16)
        c2 = c1.clone()
        store_swa_k(x, pos, slots, c1, w, 1e-6, dr, 160000.0, yarn)
        ops.store_swa_k(x, pos, slots, c2, w, 1e-6, dr, 160000.0, yarn)
        assert torch.equal(c1, c2)

    def compressor_ratio2():
        torch.manual_seed(13)
        n, d, dr = 11, 96, 32
        kv, g, pkv, pg = (torch.randn(n, d) * 2 for _ in range(4))
        w = torch.randn(d)
        pos = torch.arange(n) * 2
        assert (pair_pool(kv, g, pkv, pg) - ops.pair_pool(kv, g, pkv, pg)).abs().max() < 1e-6
        pooled = ops.pair_pool(kv, g, pkv, pg)
        lat = compressed_latent(pooled, w, 1e-20, torch.bfloat16)
        want_lat = ops.compressed_latent(pooled, w, 1e-20, torch.bfloat16)
        assert torch.equal(lat, want_lat)
        key = compressed_key(want_lat, pos, dr, 160000.0, yarn)
        want_key = ops.compressed_key(want_lat, pos, dr, 160000.0, yarn)
        assert torch.equal(key, want_key)

    def compressor_ratio1_and_index_key():
        torch.manual_seed(14)
        n, d, dr, di = 9, 96, 32, 64
        kv = torch.randn(n, d).bfloat16()
        w = torch.randn(d)
        pos = torch.arange(n) + 1000
        latent = compressed_latent(kv, w, 1e-20, torch.bfloat16)
        want_lat = ops.compressed_latent(kv, w, 1e-20, torch.bfloat16)
        assert torch.equal(latent, want_lat)
        wk, kn = torch.randn(di, d).bfloat16(), torch.randn(di)
        got = index_key(latent, wk, kn, 1e-6, pos, dr, 160000.0, yarn)
        assert torch.equal(got, ops.index_key(latent, wk, kn, 1e-6, pos, dr, 160000.0, yarn))

    def same_bits(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
            (a.float() - b.float()).abs().max()
        )

    # qat: the kernels' rounding and fake-quant steps reproduce the twins bit for bit (-0.0 too).
    def swa_key_qat():
        torch.manual_seed(15)
        # D 96 / rope 32: the RoPE tail is whole fp8 blocks; D 64 / rope 16: a block straddles it
        for t, d, dr in ((13, 96, 32), (9, 64, 16)):
            x = (torch.randn(t, d) * 3).bfloat16()
            pos = torch.randint(0, 200000, (t,))
            w = torch.randn(d).bfloat16()
            for y, theta in ((None, 10000.0), (yarn, 160000.0)):
                got = swa_key(x, pos, w, 1e-6, dr, theta, y, quant="qat")
                same_bits(got, ops.swa_key(x, pos, w, 1e-6, dr, theta, y, quant="qat"))
            slots = torch.randperm(40)[:t]
            c1 = torch.full((40, d), 7.0, dtype=torch.bfloat16)
            c2 = c1.clone()
            store_swa_k(x, pos, slots, c1, w, 1e-6, dr, 160000.0, yarn, "qat")
            ops.store_swa_k(x, pos, slots, c2, w, 1e-6, dr, 160000.0, yarn, "qat")
            same_bits(c1, c2)

    def compressed_and_index_key_qat():
        torch.manual_seed(16)
        for n, d, dr, di in ((11, 96, 32, 64), (6, 64, 16, 32)):
            lat = torch.randn(n, d).bfloat16()
            pos = torch.arange(n) * 2 + 300
            got = compressed_key(lat, pos, dr, 160000.0, yarn, quant="qat")
            same_bits(got, ops.compressed_key(lat, pos, dr, 160000.0, yarn, quant="qat"))
            wk, kn = (torch.randn(di, d) / 8).bfloat16(), torch.randn(di).bfloat16()
            got = index_key(lat, wk, kn, 1e-20, pos, dr, 160000.0, yarn, quant="qat")
            want = ops.index_key(lat, wk, kn, 1e-20, pos, dr, 160000.0, yarn, quant="qat")
            same_bits(got, want)

    def fake_quant_adversarial_rows():
        # zeros (amax floors), tiny blocks, e4m3-scale saturation (amax/6 > 448), exact e2m1
        # midpoints of the scale and -0.0: RoPE off (rope_dim 0 is not allowed: positions 0).
        d = 64
        lat = adversarial_rows(d)
        pos = torch.zeros(8, dtype=torch.long)
        got = compressed_key(lat, pos, 16, 10000.0, None, quant="qat")
        same_bits(got, ops.compressed_key(lat, pos, 16, 10000.0, None, quant="qat"))
        got = rope_index_queries(lat.view(4, 2 * d), pos[:4], 16, 10000.0, head_dim=d, quant="qat")
        want = ops.rope_index_queries(
            lat.view(4, 2 * d), pos[:4], 16, 10000.0, head_dim=d, quant="qat"
        )
        same_bits(got, want)
        got = swa_key(lat, pos, None, 1e-20, 16, 10000.0, None, quant="qat")
        same_bits(got, ops.swa_key(lat, pos, None, 1e-20, 16, 10000.0, None, quant="qat"))

    def index_queries():
        torch.manual_seed(17)
        t, h, di, dr = 7, 4, 64, 16
        qp = (torch.randn(t, h * di) * 2).bfloat16()
        pos = torch.randint(0, 5000, (t,))
        for quant in ("none", "qat"):
            got = rope_index_queries(qp, pos, dr, 160000.0, yarn, head_dim=di, quant=quant)
            want = ops.rope_index_queries(qp, pos, dr, 160000.0, yarn, head_dim=di, quant=quant)
            same_bits(got, want)

    def norm_sum_order():
        # the norm/RoPE kernel adds a row's squares as a fixed pairwise tree (columns 2j, 2j + 1,
        # then the halves; zero padding to the power of two), the same in every compiled
        # variant (docs/performance.md §31): its fp32 output equals that tree in torch bit for
        # bit, and on this data the plain sum (another order) gives other bits. With tl.sum in
        # the kernel instead, this case fails (tried).
        torch.manual_seed(23)
        t, d, eps = 64, 320, 1e-6
        x = (torch.randn(t, d) * 3).bfloat16()
        w = torch.rand(d) + 0.5
        got = compressed_latent(x, w, eps, torch.float32)
        xf = x.float()
        s = torch.nn.functional.pad(xf * xf, (0, 512 - d))
        while s.shape[1] > 1:
            s = s[:, 0::2] + s[:, 1::2]
        want = xf * torch.rsqrt(s / d + eps) * w
        assert torch.equal(got, want), (got - want).abs().max()
        plain = xf * torch.rsqrt((xf * xf).sum(1, keepdim=True) / d + eps) * w
        assert not torch.equal(plain, want)

    def rms_norm_rows():
        # the same fp32 steps but the sum of squares' order: within one bf16 rounding of the
        # twin, nearly all bitwise; each row's result independent of the other rows
        torch.manual_seed(19)
        for shape, d in (((9, 5120), 5120), ((3, 5, 1280), 1280), ((7, 96), 96)):
            x = (torch.randn(*shape) * 3).bfloat16()
            w = torch.rand(d) + 0.5
            for weight, out in ((w, None), (None, None), (w.bfloat16(), torch.float32)):
                got = rms_norm(x, weight, 1e-6, out)
                want = ops.rms_norm(x, weight, 1e-6, out)
                assert got.shape == want.shape and got.dtype == want.dtype
                g, r = got.float(), want.float()
                step = 2**-7 if got.dtype == torch.bfloat16 else 2**-20  # fp32: order only
                assert torch.all((g - r).abs() <= step * r.abs()), (g - r).abs().max()
                if got.dtype == torch.bfloat16:
                    assert (got == want).float().mean().item() >= 0.97
            rows = x.reshape(-1, d)
            assert torch.equal(rms_norm(rows[1:2], w, 1e-6), rms_norm(rows, w, 1e-6)[1:2])
        wide = torch.randn(6, 256).bfloat16()
        view = wide[:, :128]  # rows strided by 256 elements
        assert torch.equal(rms_norm(view, None, 1e-6), rms_norm(view.contiguous(), None, 1e-6))

    def mqa_logits_qat():
        torch.manual_seed(18)
        t, h, d, n = 21, 4, 64, 120
        q = fake_quant_index_fp4(torch.randn(t, h, d).bfloat16())
        k = fake_quant_index_fp4(torch.randn(n, d).bfloat16())
        w = torch.randn(t, h) / 8
        nv = torch.randint(0, 90, (t,))
        got = launch_mqa_logits(q, w, k, nv, width=96, quant="qat", config=(16, 32, 4, 1))
        assert torch.equal(got, ops.mqa_logits(q, w, k, nv, width=96, quant="qat"))
        ks = torch.cat([torch.zeros(8, dtype=torch.long), torch.full((13,), 40)])  # rows kernel
        nv = torch.minimum(nv, n - ks)
        got = launch_mqa_logits(
            q, w, k, nv, k_start=ks, width=64, quant="qat", config=(16, 32, 4, 1)
        )
        want = ops.mqa_logits(q, w, k, nv, k_start=ks, width=64, quant="qat")
        assert torch.equal(got, want)
        assert not torch.equal(want, ops.mqa_logits(q, w, k, nv, k_start=ks, width=64))

    return {name: fn for name, fn in locals().items() if name in FAST + SLOW}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
