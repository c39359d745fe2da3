"""The Gluon sparse attention kernels (kernels/attention_gluon.py, attention_gluon_ws.py,
attention_gluon_halves.py) on the CPU: their argument errors, and their sm_90 compile — shared
memory within Hopper's 227 KB, the score product issued once per key (no duplicated q·kᵀ across
warpgroups, the Triton kernel's loss, docs/performance.md §1), and, for the warp-specialised
kernels, register budgets that `setmaxnreg` can grant (more would hang the launch). Their
numerics run on the GPU: tests/gpu/test_attention_gluon_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from dsv4cp.kernels import attention_gluon as ag
from dsv4cp.kernels.attention_gluon import check_sparse_attention_gluon, gluon_attention_available

HOPPER_SMEM = 232448
REGS_PER_SM = 65536


def _inputs(t: int = 2, h: int = 64, d: int = 512, k: int = 8) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(t, h, d, dtype=torch.bfloat16),
        torch.zeros(10, d, dtype=torch.bfloat16),
        torch.zeros(t, k, dtype=torch.int32),
        torch.zeros(h),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, kv, i, s: (q[:, :32], kv, i, s), "q must be"),
        (lambda q, kv, i, s: (q[..., :256], kv, i, s), "q must be"),
        (lambda q, kv, i, s: (q, kv[:, :256], i, s), "kv must be"),
        (lambda q, kv, i, s: (q, kv, i[:1], s), "indices must be"),
        (lambda q, kv, i, s: (q.float(), kv, i, s), "must be bf16"),
        (lambda q, kv, i, s: (q, kv.half(), i, s), "must be bf16"),
        (lambda q, kv, i, s: (q, kv, i, s[:3]), "sink must be"),
    ],
    ids=["heads", "q-width", "kv-width", "index-rows", "q-dtype", "kv-dtype", "sink"],
)
def test_bad_inputs_name_the_limit(change, message: str) -> None:
    if not ag.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    with pytest.raises(ValueError, match=message):
        check_sparse_attention_gluon(*change(*_inputs()))


def test_not_available_off_the_gpu() -> None:
    assert not gluon_attention_available(_inputs()[0])


def _compiled(which: str, config: tuple[int, int] | None = None) -> object:
    if not ag.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    try:
        if which.startswith("ws"):
            from dsv4cp.kernels import attention_gluon_ws

            return attention_gluon_ws.compile_ws_for_hopper(
                config=config or attention_gluon_ws.WS_CONFIG
            )
        return ag.compile_for_hopper(*(config or ag.PIPELINED_CONFIG))
    except (ImportError, RuntimeError) as exc:  # no CUDA backend in this triton build
        if "backend" in str(exc).lower():
            pytest.skip(f"triton cannot target CUDA here: {exc}")
        raise


def _mma_shapes(ptx: str) -> list[str]:
    return re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)


CONFIGS = pytest.mark.parametrize("config", ag.PIPELINED_CONFIGS, ids=lambda c: f"bn{c[0]}x{c[1]}")


@CONFIGS
def test_the_pipelined_kernel_fits_and_splits_the_scores_by_key(config: tuple[int, int]) -> None:
    kernel = _compiled("pipelined", config)
    assert int(kernel.metadata.shared) <= HOPPER_SMEM
    shapes = _mma_shapes(kernel.asm["ptx"])
    # q·kᵀ: each warpgroup takes half the tile's keys over the 512 columns (32 steps of k16);
    # p·v: each takes half the output columns over the tile's keys
    block_n = config[0]
    assert shapes.count(f"m64n{block_n // 2}k16") == 512 // 16
    assert shapes.count("m64n256k16") == block_n // 16


def _unguarded_writes(ptx: str) -> list[str]:
    """Shared writes that an in-flight wgmma may still read: a kv copy (cp.async) or a p store
    (stmatrix) with no CTA-wide `bar.sync 0` since the last `wgmma.wait_group` before it. Text
    order: the kernel's loop is emitted as straight blocks whose text order is their order on
    every path that reaches a write (read off the PTX of both configs)."""
    bad, waited, barrier = [], False, False
    for n, line in enumerate(ptx.splitlines()):
        if "wgmma.wait_group" in line:
            waited, barrier = True, False
        elif re.search(r"\bbar\.sync\s+0;", line):
            barrier = True
        elif waited and not barrier and ("cp.async.cg.shared" in line or "stmatrix" in line):
            bad.append(f"{n}: {line.strip()}")
    return bad


@CONFIGS
def test_no_shared_buffer_is_rewritten_under_the_other_warpgroups_wgmma(
    config: tuple[int, int],
) -> None:
    """Both warpgroups read every kv tile and p tile through asynchronous wgmma; a thread's own
    wait covers only its warpgroup. Each rewrite must come after a CTA barrier that follows the
    waits (the module docstring's invariant; a Triton whose membar pass dropped the barrier
    before the next copy would race)."""
    ptx = _compiled("pipelined", config).asm["ptx"]
    assert "wgmma.wait_group" in ptx and "stmatrix" in ptx
    assert _unguarded_writes(ptx) == []
    # witness: the same order with the barriers removed is caught
    assert _unguarded_writes(re.sub(r"bar\.sync\s+0;", "", ptx))


@pytest.mark.parametrize("config", [(64, 2), (32, 4)], ids=["bn64x2", "bn32x4"])
def test_the_warp_specialised_kernel_fits_and_its_registers_can_be_granted(
    config: tuple[int, int],
) -> None:
    from dsv4cp.kernels import attention_gluon_ws as ws

    assert config in ws.WS_CONFIGS
    kernel = _compiled("ws", config)
    assert int(kernel.metadata.shared) <= HOPPER_SMEM
    ptx = kernel.asm["ptx"]
    shapes = _mma_shapes(ptx)
    # each math warpgroup's code (two partitions): q·kᵀ of its own BN-key tile over 512 columns,
    # then p·v into its 256 output columns twice (its own p from registers, the other's)
    block_n, nbuf = config
    assert shapes.count(f"m64n{block_n}k16") == 2 * 512 // 16
    assert shapes.count("m64n256k16") == 2 * 2 * block_n // 16
    # one ready and one free barrier per buffer, plus q_ready, the m, p, l exchanges' three and
    # two unused ones (kept for the measured SASS: the kernel's comment)
    assert len(re.findall(r"mbarrier\.init", ptx)) == 2 * nbuf + 6
    granted = {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert ws.MATH_REGS in granted
    # three warpgroups of 128 threads share the register file: what they ask must fit
    default = 3 * ws.MAXNREG - ws.MATH_REGS - ws.LOAD_REGS
    assert 128 * (default + ws.MATH_REGS + ws.LOAD_REGS) <= REGS_PER_SM
    assert f".maxnreg {ws.MAXNREG}" in ptx
    # the loader never waits for its own tile copies (§26): each thread's copies arrive on the
    # tile's barrier; the one wait_group left is the query's, before the loop
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 1
    assert len(re.findall(r"cp\.async\.wait_group", ptx)) == 1


def test_the_half_buffer_kernel_fits_and_its_registers_can_be_granted() -> None:
    if not ag.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from dsv4cp.kernels import attention_gluon_halves as hv

    try:
        kernel = hv.compile_halves_for_hopper()
    except (ImportError, RuntimeError) as exc:
        if "backend" in str(exc).lower():
            pytest.skip(f"triton cannot target CUDA here: {exc}")
        raise
    assert int(kernel.metadata.shared) <= HOPPER_SMEM
    ptx = kernel.asm["ptx"]
    # q·kᵀ on 64-key tiles, p·v into 256 columns: no other MMA shape
    assert set(_mma_shapes(ptx)) == {"m64n64k16", "m64n256k16"}
    # four halves' ready and free barriers, then q_ready, m_a, m_b, p_a, p_b, l
    assert len(re.findall(r"mbarrier\.init", ptx)) == 4 + 4 + 6
    # the query's and each half's copies arrive on their own barrier (.noinc): no wait_group
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 5
    assert not re.findall(r"cp\.async\.wait_group", ptx)
    granted = {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert hv.MATH_REGS in granted
    default = hv.check_regs(hv.MATH_REGS, hv.LOAD_REGS)  # the first math warpgroup's rest
    assert 128 * (default + hv.MATH_REGS + hv.LOAD_REGS) <= REGS_PER_SM


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(config=(48, 3)), "config must be one of"),
    ],
    ids=["config"],
)
def test_the_warp_specialised_kernel_names_a_bad_variant(kwargs: dict, message: str) -> None:
    """An unknown (keys, buffers) is refused before any compile or launch."""
    if not ag.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from dsv4cp.kernels import attention_gluon_ws as ws

    with pytest.raises(ValueError, match=message):
        ws.sparse_attention_gluon_ws(*_inputs(), 0.04, **kwargs)
    with pytest.raises(ValueError, match=message):
        ws.compile_ws_for_hopper(**kwargs)


@pytest.mark.parametrize(
    ("math_regs", "load_regs", "name"),
    [(230, 40, "math_regs"), (216, 16, "load_regs"), (200, 40, "the rest"), (264, 24, "math_regs")],
    ids=["not-a-multiple-of-8", "loader-below-24", "rest-above-256", "math-above-256"],
)
def test_the_half_buffer_kernel_names_a_bad_register_grant(
    math_regs: int, load_regs: int, name: str
) -> None:
    """A grant `setmaxnreg` cannot take (not a multiple of 8, outside [24, 256], or leaving the
    first math warpgroup such a rest) is refused before any compile or launch."""
    if not ag.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    from dsv4cp.kernels import attention_gluon_halves as hv

    with pytest.raises(ValueError, match=f"{name} must be a multiple of 8"):
        hv.sparse_attention_gluon_halves(*_inputs(), 0.04, math_regs=math_regs, load_regs=load_regs)
    with pytest.raises(ValueError, match=f"{name} must be a multiple of 8"):
        hv.compile_halves_for_hopper(math_regs, load_regs)
    assert hv.check_regs(hv.MATH_REGS, hv.LOAD_REGS) == 3 * hv.MAXNREG - hv.MATH_REGS - hv.LOAD_REGS
