"""Where FlashMLA does not run, kernels/flashmla sends a query the Gluon sm_90 kernel takes
(Hopper, 64 heads × 512, bf16) to it, over the same bf16 workspace FlashMLA reads —
`DSV4CP_GLUON_ATTENTION` auto (the default) and on; auto not under `DSV4CP_FLASHMLA=off`.
On the CPU the Gluon kernel is replaced by the ops' dense attention (as the fake FlashMLA is in
test_flashmla_cached.py), so these check the dispatch, the workspace it is given and the log
line; the kernel itself runs in tests/gpu/test_attention_gluon_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4cp import env_vars, ops
from dsv4cp.kernels import attention as triton_attention
from dsv4cp.kernels import (
    attention_gluon,
    attention_gluon_halves,
    attention_workspace,
    flashmla,
)
from tests.kernels.test_flashmla_cached import FP4, FP8, _caches, _install
from tests.kernels.test_flashmla_dispatch import FakeFlashMLA

STAND_IN = "Gluon sm_90 half-buffer kernel (FlashMLA: flash_mla is not installed)"


@pytest.fixture
def gluon(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """No flash_mla, an SM90 device, the flag at its default (auto); the Gluon kernel's calls
    (kv and index shapes) recorded."""
    calls: list[tuple[int, ...]] = []

    def fake(q, kv, indices, sink, scale):  # type: ignore[no-untyped-def]
        calls.append((*kv.shape, *indices.shape))
        return ops.sparse_attention(q, kv, indices, sink, scale)

    monkeypatch.setattr(flashmla, "_module", [None])
    monkeypatch.setattr(flashmla, "_said", set())
    monkeypatch.setattr(flashmla, "_capability", lambda x: (9, 0))
    monkeypatch.setattr(attention_gluon, "HAVE_GLUON", True)
    monkeypatch.setattr(attention_gluon_halves, "sparse_attention_gluon_halves", fake)
    monkeypatch.delenv(flashmla.ENV_FLAG, raising=False)
    monkeypatch.delenv(flashmla.GLUON_ENV, raising=False)
    return calls


def test_the_gluon_kernel_over_the_workspace_equals_the_cached_op(
    gluon: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dsv4cp.kernels")
    q, swa, win, comp, top, sink = _caches(seed=2)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4)
    want = ops.sparse_attention_cached(*args)
    # 1 byte: chunks of MIN_CHUNK_ROWS
    for budget in (attention_workspace.WORKSPACE_BUDGET_BYTES, 1):
        monkeypatch.setattr(attention_workspace, "WORKSPACE_BUDGET_BYTES", budget)
        monkeypatch.setattr(attention_workspace, "MIN_CHUNK_ROWS", 2)
        out = flashmla.sparse_attention_cached(*args)
        assert torch.all(out[1] == 0)  # the row with no key
        # the same keys in the same order: equal up to the sums' grouping
        diff = (out.float() - want.float()).abs()
        assert diff.max() <= 2**-7 * want.float().abs().max(), budget
    # one call over the whole batch, then three chunks; no -1 padding to 64 (FlashMLA's)
    assert len(gluon) == 4
    assert gluon[0][1:] == (512, 6, win.shape[1] + top.shape[1])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"sparse attention: {STAND_IN} over a bf16 workspace"]


def test_dense_rows_go_to_the_gluon_kernel(gluon: list[tuple[int, ...]]) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 64, 512, generator=g).bfloat16()
    kv = torch.randn(40, 512, generator=g).bfloat16()
    idx = torch.randint(-1, 40, (3, 30), generator=g)
    sink = torch.randn(64, generator=g)
    assert flashmla.sparse_attention_backend(q, kv, idx, sink) == STAND_IN
    out = flashmla.sparse_attention(q, kv, idx, sink, 0.05)
    assert torch.equal(out, ops.sparse_attention(q, kv, idx, sink, 0.05))
    assert gluon == [(40, 512, 3, 30)]
    # fp32 rows: not the Gluon kernel's
    assert flashmla.sparse_attention_backend(q, kv.float(), idx, sink).startswith("Triton")


@pytest.mark.parametrize("flag", ["auto", "on", "1", "yes"])
def test_auto_and_on_stand_in_where_flashmla_is_missing(
    gluon: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    monkeypatch.setenv(flashmla.GLUON_ENV, flag)
    q = _caches()[0]
    assert flashmla.sparse_attention_cached_backend(q) == f"{STAND_IN} over a bf16 workspace"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m, q: m.setenv(flashmla.GLUON_ENV, "off"), "DSV4CP_GLUON_ATTENTION=off"),
        (lambda m, q: m.setenv(flashmla.GLUON_ENV, "0"), "DSV4CP_GLUON_ATTENTION=off"),
        (lambda m, q: m.setattr(flashmla, "_capability", lambda x: (8, 0)), "needs SM90"),
        (lambda m, q: m.setattr(attention_gluon, "HAVE_GLUON", False), "has no Gluon"),
    ],
    ids=["flag-off", "flag-0", "not-hopper", "no-gluon"],
)
def test_otherwise_the_triton_kernel_over_the_workspace(
    gluon: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch, change, reason: str
) -> None:
    q, swa, win, comp, top, sink = _caches(seed=5)
    change(monkeypatch, q)
    backend = flashmla.sparse_attention_cached_backend(q)
    assert backend.startswith(
        "Triton kernel over a workspace (FlashMLA: flash_mla is not installed; Gluon: "
    )
    assert reason in (flashmla.gluon_misfit(q) or "")
    calls: list[int] = []

    def fake_triton(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return ops.sparse_attention_cached(*a, **kw)

    monkeypatch.setattr(triton_attention, "sparse_attention_cached", fake_triton)
    flashmla.sparse_attention_cached(q, swa, win, comp, top, sink, 0.1, FP8, FP4)
    assert calls == [1] and gluon == []


def test_the_gluon_shape_limits_are_named(gluon: list[tuple[int, ...]]) -> None:
    q = _caches(h=4)[0]
    assert "takes [T, 64, 512]" in (flashmla.gluon_misfit(q) or "")
    assert "bf16" in (flashmla.gluon_misfit(torch.zeros(2, 64, 512)) or "")
    assert flashmla.gluon_misfit(torch.zeros(2, 64, 512, dtype=torch.bfloat16)) is None


def test_flashmla_wins_where_it_runs(
    gluon: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(monkeypatch, FakeFlashMLA())
    q = _caches()[0]
    assert flashmla.sparse_attention_cached_backend(q).startswith("FlashMLA")
    # FlashMLA off asks for the Triton kernels (the reference-exact qat path): auto keeps them
    monkeypatch.setenv(flashmla.ENV_FLAG, "off")
    backend = flashmla.sparse_attention_cached_backend(q)
    assert backend.startswith("Triton cached kernel (DSV4CP_FLASHMLA=off)")
    assert "DSV4CP_FLASHMLA=off keeps the Triton kernels" in (flashmla.gluon_misfit(q) or "")
    monkeypatch.setenv(flashmla.GLUON_ENV, "on")  # on: the Gluon kernel stands in there too
    assert flashmla.sparse_attention_cached_backend(q) == (
        "Gluon sm_90 half-buffer kernel (FlashMLA: DSV4CP_FLASHMLA=off) over a bf16 workspace"
    )


def test_a_bad_flag_value_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flashmla.GLUON_ENV, "maybe")
    with pytest.raises(env_vars.EnvVarError, match="DSV4CP_GLUON_ATTENTION"):
        env_vars.check_environment()
