"""kernels/flashmla: which backend sparse attention takes, with a fake `flash_mla` on the CPU.

Shapes FlashMLA takes (H 64 or 128, D 512, bf16) go to `flash_mla.flash_mla_sparse_fwd` with its
layout (kv [N, 1, 512], int32 indices [T, 1, K] padded with -1 to a multiple of 64, fp32 sink,
the legacy kernels on SM90); the others, or no `flash_mla`, go to the Triton kernel. Each choice
is logged once. The GPU test runs the real wheel against the ops twin where it is installed.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

from dsv4cp import ops
from dsv4cp.kernels import attention as triton_attention
from dsv4cp.kernels import flashmla


class FakeFlashMLA(ModuleType):
    def __init__(self, legacy: bool = True) -> None:
        super().__init__("flash_mla")
        self.__version__ = "1.0.0"
        self.legacy = legacy
        self.calls: list[dict[str, Any]] = []

    def has_legacy(self) -> bool:
        return self.legacy

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, **kw):  # type: ignore[no-untyped-def]
        self.calls.append(dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, **kw))
        out = ops.sparse_attention(q, kv[:, 0], indices[:, 0], kw["attn_sink"], sm_scale)
        return out, None, None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashMLA:
    mod = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    monkeypatch.setattr(flashmla, "_module", [])
    monkeypatch.setattr(flashmla, "_said", set())
    monkeypatch.setattr(flashmla, "_capability", lambda x: (9, 0))
    monkeypatch.delenv(flashmla.ENV_FLAG, raising=False)
    return mod


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []

    def fake_triton(q, kv, indices, sink, scale):  # type: ignore[no-untyped-def]
        calls.append(tuple(q.shape))
        return ops.sparse_attention(q, kv, indices, sink, scale)

    monkeypatch.setattr(triton_attention, "sparse_attention", fake_triton)
    return calls


def _inputs(t: int = 3, h: int = 64, d: int = 512, k: int = 100, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(h + d + k)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(40, d, generator=g).to(dtype)
    idx = torch.randint(-1, 40, (t, k), generator=g, dtype=torch.int32)
    return q, kv, idx, torch.randn(h, generator=g)


def test_fitting_shapes_go_to_flashmla(
    fake: FakeFlashMLA, triton_calls: list, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dsv4cp.kernels")
    for h, k in ((64, 100), (128, 640), (64, 64)):
        q, kv, idx, sink = _inputs(h=h, k=k)
        out = flashmla.sparse_attention(q, kv, idx.long() if k == 64 else idx, sink, 0.04)
        call = fake.calls[-1]
        width = -(-k // 64) * 64
        assert call["indices"].shape == (3, 1, width) and call["indices"].dtype == torch.int32
        assert torch.all(call["indices"][:, 0, k:] == -1)
        assert torch.equal(call["indices"][:, 0, :k], idx)
        assert call["kv"].shape == (40, 1, 512) and call["kv"].data_ptr() == kv.data_ptr()
        assert call["sm_scale"] == 0.04 and call["d_v"] == 512 and call["use_legacy"] is True
        assert call["attn_sink"].dtype == torch.float32
        want = ops.sparse_attention(q, kv, idx, sink, 0.04)  # the -1 pad changes only the order
        assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert not triton_calls
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["sparse attention: FlashMLA sparse prefill (sgl-flash-mla 1.0.0)"]


@pytest.mark.parametrize(
    ("h", "d", "dtype", "reason"),
    [
        (4, 512, torch.bfloat16, "H=4"),
        (64, 96, torch.bfloat16, "D=96"),
        (64, 512, torch.float32, "bf16"),
    ],
)
def test_other_shapes_go_to_triton(
    fake: FakeFlashMLA,
    triton_calls: list,
    caplog: pytest.LogCaptureFixture,
    h: int,
    d: int,
    dtype: torch.dtype,
    reason: str,
) -> None:
    caplog.set_level(logging.INFO, logger="dsv4cp.kernels")
    q, kv, idx, sink = _inputs(h=h, d=d, dtype=dtype)
    for _ in range(2):
        flashmla.sparse_attention(q, kv, idx, sink, 0.1)
    assert not fake.calls and len(triton_calls) == 2
    (line,) = [r.getMessage() for r in caplog.records]  # said once
    assert line.startswith("sparse attention: Triton kernel (") and reason in line


def test_no_flashmla_no_legacy_or_switched_off(
    fake: FakeFlashMLA, triton_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, kv, idx, sink = _inputs()
    assert flashmla.sparse_attention_backend(q, kv, idx, sink).startswith("FlashMLA")
    monkeypatch.setenv(flashmla.ENV_FLAG, "off")
    assert "DSV4CP_FLASHMLA=off" in flashmla.sparse_attention_backend(q, kv, idx, sink)
    monkeypatch.delenv(flashmla.ENV_FLAG)
    fake.legacy = False
    assert "legacy" in flashmla.sparse_attention_backend(q, kv, idx, sink)
    monkeypatch.setattr(flashmla, "_capability", lambda x: (8, 0))
    assert "needs SM90 or SM100" in flashmla.sparse_attention_backend(q, kv, idx, sink)
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import fails
    monkeypatch.setattr(flashmla, "_module", [])
    assert "not installed" in flashmla.sparse_attention_backend(q, kv, idx, sink)
    flashmla.sparse_attention(q, kv, idx, sink, 0.1)
    assert triton_calls and not fake.calls


def test_bad_shapes_raise_before_dispatch(fake: FakeFlashMLA) -> None:
    q, kv, idx, sink = _inputs()
    with pytest.raises(ValueError, match="sink must be"):
        flashmla.sparse_attention(q, kv, idx, sink[:3], 0.1)
    assert not fake.calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_flashmla_matches_ops() -> None:
    pytest.importorskip("flash_mla")
    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, d, n, k = 96, 64, 512, 5000, 640
    q = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, n, (t, k), device="cuda", generator=g, dtype=torch.int32)
    idx[:, 500:] = -1  # V4.1 rows: fewer top-k entries than slots
    idx[1, :] = -1  # a row with no key (a padding row): 0, as ops gives
    idx[2, 3:] = -1
    sink = torch.randn(h, device="cuda", generator=g)
    assert flashmla.sparse_attention_backend(q, kv, idx, sink).startswith("FlashMLA")
    out = flashmla.sparse_attention(q, kv, idx, sink, d**-0.5)
    want = ops.sparse_attention(q, kv, idx, sink, d**-0.5)
    assert torch.all(out[1] == 0), "a row with no valid index must give 0"
    diff = (out.float() - want.float()).abs()
    assert diff.max() < 2e-2 and diff.norm() / want.float().norm() < 1e-2
    ragged = idx[:, :600]  # not a multiple of 64: padded with -1
    out2 = flashmla.sparse_attention(q, kv, ragged, sink, d**-0.5)
    want2 = ops.sparse_attention(q, kv, ragged, sink, d**-0.5)
    assert (out2.float() - want2.float()).abs().max() < 2e-2
