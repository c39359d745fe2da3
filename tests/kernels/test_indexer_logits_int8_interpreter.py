"""kernels/indexer_logits_int8 on the CPU through Triton's interpreter: the int8 encoding's
exactness flags, and the int8 kernel's logits bit-equal to the bf16 qat kernel's
(`indexer_logits.launch_mqa_logits(quant="qat")`) on fake-fp4 inputs, the per-tile bf16 branch
included (vectors the encoding cannot hold exactly), with and without k_start.

The cases run in one child process (TRITON_INTERPRET must be set before triton is imported).
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ("encode_flags", "logits_equal", "logits_fallback_tiles", "logits_k_start")
CFG = (16, 32, 4, 1)  # BLOCK_T, BLOCK_N, warps, stages: several row blocks and key tiles


@pytest.fixture(scope="module")
def child_results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_indexer_logits_int8_in_the_interpreter(case: str, child_results: dict[str, str]) -> None:
    assert child_results[case] == "ok", child_results[case]


def _cases() -> dict[str, object]:
    import torch

    from dsv4cp.kernels.indexer_logits import launch_mqa_logits
    from dsv4cp.kernels.indexer_logits_int8 import encode_int8, launch_mqa_logits_int8
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4

    def fp4(*shape: int, seed: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        return fake_quant_index_fp4(x).bfloat16()

    def inputs(t: int, h: int, n: int, seed: int):
        q, k = fp4(t, h, 128, seed=seed), fp4(n, 128, seed=seed + 1)
        w = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)) / h
        nv = torch.randint(0, n + 1, (t,), generator=torch.Generator().manual_seed(seed + 3))
        return q, w, k, nv.int()

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        # bit for bit, NaN where NaN
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad = (got != want) & ~(got.isnan() & want.isnan())
            rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten()[:3].tolist()
            raise AssertionError(f"{what}: rows {rows} differ: {got[rows]} vs {want[rows]}")

    def encode_flags():
        # codes · 2^E give the vector back where ok; the flag falls where it cannot
        q, w, k, _ = inputs(6, 4, 9, seed=1)
        codes, kscale, kok = encode_int8(k)
        assert kok.tolist() == [1] * 9
        assert torch.equal(codes.float() * kscale[:, None], k.float())
        qc, w2, qok = encode_int8(q, w)
        assert qok.tolist() == [1] * 6
        wb = w.bfloat16().float()
        assert torch.equal(qc.float() * (w2 / wb)[..., None], q.float())
        assert codes.abs().max() <= 127 and codes.abs().max() >= 64
        # block exponents: a block 2^3 below the largest holds 0.5 and 1.5 exactly, 2^4 not
        base = torch.zeros(4, 128)
        base[:, 0] = 6.0  # the largest block's amax: E = 2 - 6
        base[0, 32] = 0.5 * 2.0**-3
        base[1, 32] = 1.5 * 2.0**-3
        base[2, 32] = 0.5 * 2.0**-4  # below 2^E: not an integer multiple
        base[3, 32] = 1.0 * 2.0**-4  # 2^-4 = 2^E: still exact
        assert encode_int8(base.bfloat16())[2].tolist() == [1, 1, 0, 1]
        # E outside [-30, 30], inf and NaN, an all-zero vector (ok, codes 0)
        odd = torch.zeros(5, 128)
        odd[0, 0] = 2.0**-40
        odd[1, 0] = 2.0**40
        odd[2, 0] = float("inf")
        odd[3, 0] = float("nan")
        c, s, ok = encode_int8(odd.bfloat16())
        assert ok.tolist() == [0, 0, 0, 0, 1] and torch.equal(
            c[4], torch.zeros(128, dtype=torch.int8)
        )
        # a query row is usable only if every head is, and every nonzero weight is in range
        w_odd = w.clone()
        w_odd[1, 2] = 2.0**-31
        w_odd[2, 0] = 0.0
        w_odd[3, 3] = 2.0**31
        q_odd = q.clone()
        q_odd[4, 1] *= 2.0**-40
        assert encode_int8(q_odd, w_odd)[2].tolist() == [1, 0, 1, 0, 0, 1]

    def logits_equal():
        q, w, k, nv = inputs(37, 4, 150, seed=2)
        nv[:4] = torch.tensor([150, 0, 1, 33])
        for fill in (True, False):
            want = launch_mqa_logits(q, w, k, nv, quant="qat", config=CFG, fill=fill)
            got = launch_mqa_logits_int8(q, w, k, nv, config=CFG, fill=fill)
            magic = launch_mqa_logits_int8(q, w, k, nv, config=CFG, fill=fill, convert="magic",
                                           maxnreg=None, relu_fma=False)  # fmt: skip
            seen = torch.arange(150)[None, :] < nv[:, None]
            if fill:
                same(got, want, "fill")
                same(magic, want, "convert=magic")
            else:  # the hidden entries stay unwritten
                same(got[seen], want[seen], "fill=False")
                same(magic[seen], want[seen], "convert=magic, fill=False")
        got = launch_mqa_logits_int8(q, w, k, nv, config=CFG, k_encoded=encode_int8(k), width=100)
        want = launch_mqa_logits(q, w, k, nv, quant="qat", config=CFG, width=100)
        same(got, want, "encoded once")

    def logits_fallback_tiles():
        # vectors the encoding cannot hold: their tiles take the bf16 steps; NaN propagates alike
        q, w, k, nv = inputs(40, 4, 130, seed=3)
        k[7, 32:64] *= 2.0**-9
        k[70, 5] = float("nan")
        q[5, 2] *= 2.0**-40
        w[20, 1] = 2.0**-35
        q[33, 0, 0] = float("inf")
        assert encode_int8(k)[2][[7, 70]].tolist() == [0, 0]
        assert encode_int8(q, w)[2][[5, 20, 33]].tolist() == [0, 0, 0]
        want = launch_mqa_logits(q, w, k, nv, quant="qat", config=CFG)
        same(launch_mqa_logits_int8(q, w, k, nv, config=CFG), want, "fallback tiles")

    def logits_k_start():
        # two requests in one launch: the shared-k_start blocks on int8, the mixed ones per row
        q, w, k, nv = inputs(29, 4, 160, seed=4)
        ks = torch.cat([torch.zeros(11, dtype=torch.long), torch.full((18,), 50)])
        nv = torch.minimum(nv, (160 - ks).int())
        want = launch_mqa_logits(q, w, k, nv, k_start=ks, width=96, quant="qat", config=CFG)
        got = launch_mqa_logits_int8(q, w, k, nv, k_start=ks, width=96, config=CFG)
        same(got, want, "k_start")

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
