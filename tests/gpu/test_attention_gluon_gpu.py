"""The Gluon sparse attention kernels (kernels/attention_gluon.py at each of PIPELINED_CONFIGS,
kernels/attention_gluon_ws.py at its configurations,
kernels/attention_gluon_halves.py) on a Hopper GPU against their twin,
ops.attention.sparse_attention, and against the Triton kernel, with the Triton kernel's
tolerances (docs/performance.md §1, *Tolerances*): max |Δ| < 2e-2 and ‖Δ‖ / ‖ops‖ < 1e-2 (p is
rounded to bf16 for p·v), exact zeros for rows with no valid index. The warp-specialised kernels
(ws, half-buffer) first run in a child process with a time limit (`ws_terminates`). The last
test runs the routed path (`DSV4CP_GLUON_ATTENTION=on`: the half-buffer kernel over FlashMLA's
workspace). The CPU checks
(compile for sm_90, the layouts, the argument errors): tests/kernels/test_attention_gluon.py."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4cp import ops
from dsv4cp.kernels.attention import sparse_attention as triton_attention
from dsv4cp.kernels.attention_gluon import (
    PIPELINED_CONFIGS,
    gluon_attention_available,
    sparse_attention_gluon,
)
from dsv4cp.kernels.attention_gluon_halves import sparse_attention_gluon_halves
from dsv4cp.kernels.attention_gluon_ws import sparse_attention_gluon_ws

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
H, D = 64, 512
WS_SMOKE_TIMEOUT_S = (
    300  # three compiles and 15 launches; a hang is a deadlock in the mbarrier protocol
)


@pytest.fixture(scope="module")
def ws_terminates() -> None:
    """The half-buffer kernel at 1 to 80 tiles (odd counts too), then the ws kernel's
    configurations at 1, 3, 10 and 80 tiles, in a child process with a time limit:
    a deadlock fails here instead of hanging the suite."""
    code = textwrap.dedent(
        """
        import torch
        from dsv4cp.kernels.attention_gluon_ws import WS_CONFIGS, sparse_attention_gluon_ws
        from dsv4cp.kernels.attention_gluon_halves import sparse_attention_gluon_halves
        for k in (1, 64, 100, 128, 130, 640, 5120):
            q = torch.randn(3, 64, 512, device="cuda").bfloat16()
            kv = torch.randn(900, 512, device="cuda").bfloat16()
            idx = torch.randint(0, 900, (3, k), device="cuda", dtype=torch.int32)
            sparse_attention_gluon_halves(q, kv, idx, torch.zeros(64, device="cuda"), 0.04)
            torch.cuda.synchronize()
        for k, config in [(k, c) for c in WS_CONFIGS for k in (64, 130, 640, 5120)]:
            q = torch.randn(3, 64, 512, device="cuda").bfloat16()
            kv = torch.randn(900, 512, device="cuda").bfloat16()
            idx = torch.randint(0, 900, (3, k), device="cuda", dtype=torch.int32)
            sparse_attention_gluon_ws(
                q, kv, idx, torch.zeros(64, device="cuda"), 0.04, config=config
            )
            torch.cuda.synchronize()
        """
    )
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        subprocess.run(
            [sys.executable, "-c", code], check=True, timeout=WS_SMOKE_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the warp-specialised kernel did not finish in {WS_SMOKE_TIMEOUT_S} s")


def _kernel(request: pytest.FixtureRequest, name: str):  # type: ignore[no-untyped-def]
    if name == "halves":
        request.getfixturevalue("ws_terminates")
        return sparse_attention_gluon_halves
    if name.startswith("ws"):
        request.getfixturevalue("ws_terminates")
        config = (32, 4) if name.startswith("ws32x4") else (64, 2)
        return functools.partial(sparse_attention_gluon_ws, config=config)
    block_n, nbuf = (int(x) for x in name[2:].split("x"))
    return functools.partial(sparse_attention_gluon, config=(block_n, nbuf))


NAMES = [f"bn{b}x{n}" for b, n in PIPELINED_CONFIGS] + ["ws64x2", "ws32x4", "halves"]
KERNELS = pytest.mark.parametrize("name", NAMES)


def _needs_gluon() -> None:
    if not gluon_attention_available(torch.empty(1, H, D, device="cuda")):
        pytest.skip("needs Gluon and a Hopper GPU")


def _inputs(t: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, n, (t, k), device="cuda", generator=g, dtype=torch.int32)
    sink = torch.randn(H, device="cuda", generator=g)
    return q, kv, idx, sink


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    d = (out.float() - ref.float()).abs()
    assert d.max().item() < 2e-2
    assert (d.norm() / ref.float().norm().clamp_min(1e-30)).item() < 1e-2


@KERNELS
@pytest.mark.parametrize(
    ("t", "n", "k"),
    [(1, 100, 64), (37, 300, 640), (64, 2048, 200), (5, 50, 1), (3, 90, 130), (4, 60, 0)],
    ids=["one-tile", "ten-tiles", "ragged", "one-key", "three-tiles", "no-keys"],
)
def test_gluon_equals_the_twin(request, name: str, t: int, n: int, k: int) -> None:
    _needs_gluon()
    kernel = _kernel(request, name)
    q, kv, idx, sink = _inputs(t, n, k, seed=t + k)
    scale = D**-0.5
    out = kernel(q, kv, idx, sink, scale)
    _close(out, ops.sparse_attention(q, kv, idx, sink, scale))
    _close(out, triton_attention(q, kv, idx, sink, scale))


@KERNELS
def test_masked_indices_rows_without_keys_and_an_absent_sink(request, name: str) -> None:
    """-1 and out-of-range indices are skipped; a row with none valid gives exact zeros; a −∞
    sink (no sink) and a large one both follow the twin."""
    _needs_gluon()
    t, n, k = 48, 400, 192
    q, kv, idx, sink = _inputs(t, n, k, seed=7)
    g = torch.Generator(device="cuda").manual_seed(8)
    drop = torch.rand(t, k, device="cuda", generator=g) < 0.4
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    idx[3, 10:20] = n + 5  # past the cache: masked like -1
    idx[5] = -1  # no valid key
    idx[6, :130] = -1  # the first two tiles empty, the third partly
    sink[:8] = float("-inf")
    sink[8:16] = 30.0
    scale = D**-0.5
    out = _kernel(request, name)(q, kv, idx, sink, scale)
    ref = ops.sparse_attention(q, kv, torch.where(idx < n, idx, -1), sink, scale)
    _close(out, ref)
    assert torch.equal(out[5], torch.zeros_like(out[5]))


@KERNELS
def test_duplicate_indices_count_per_occurrence(request, name: str) -> None:
    _needs_gluon()
    kernel = _kernel(request, name)
    q, kv, idx, sink = _inputs(16, 32, 128, seed=9)
    idx[:, 64:] = idx[:, :64]
    out = kernel(q, kv, idx, sink, 0.07)
    _close(out, ops.sparse_attention(q, kv, idx, sink, 0.07))


@KERNELS
def test_empty_batch_and_strided_inputs(request, name: str) -> None:
    _needs_gluon()
    kernel = _kernel(request, name)
    q, kv, idx, sink = _inputs(8, 128, 96, seed=10)
    assert kernel(q[:0], kv, idx[:0], sink, 0.05).shape == (0, H, D)
    wide = torch.zeros(128, 2 * D, device="cuda", dtype=torch.bfloat16)
    wide[:, :D] = kv
    out = kernel(q, wide[:, :D], idx.long(), sink, 0.05)
    _close(out, ops.sparse_attention(q, kv, idx, sink, 0.05))


def test_the_routed_gluon_path_over_the_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """`DSV4CP_GLUON_ATTENTION=on` with FlashMLA off: the layer's call over fp8 / fp4 caches
    runs the Gluon kernel over the bf16 workspace, equals the twin and the Triton cached kernel,
    and replays in a CUDA graph over new cache contents."""
    _needs_gluon()
    from dsv4cp.kernels import flashmla
    from dsv4cp.ops.kv_format import encode_rows
    from tests.gpu.test_fast_path import FP4, FP8, _attention_inputs

    monkeypatch.setenv(flashmla.ENV_FLAG, "off")
    monkeypatch.setenv(flashmla.GLUON_ENV, "on")
    q, swa, win, comp, top, sink = _attention_inputs(seed=11)
    backend = flashmla.sparse_attention_cached_backend(q)
    assert backend.startswith("Gluon sm_90 half-buffer kernel")
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, "none")
    out = flashmla.sparse_attention_cached(*args)
    assert torch.all(out[1] == 0), "a row with no key gives 0"
    _close(out, ops.sparse_attention_cached(*args))
    _close(out, flashmla.triton_attention.sparse_attention_cached(*args))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashmla.sparse_attention_cached(*args)
    swa.copy_(encode_rows(torch.randn(swa.shape[0], 512, device="cuda"), FP8, dense_dtype=q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, flashmla.sparse_attention_cached(*args))
