"""Routing: CPU → ops, CUDA → kernel unless DSV4CP_KERNELS=torch, the kernels' shape limits, and
one signature for each kernel and its op."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from dsv4cp import env_vars, ops, routing
from dsv4cp.kernels.attention import check_sparse_attention
from dsv4cp.kernels.indexer_logits import check_mqa_logits
from dsv4cp.kernels.topk import check_topk

# Every op the attention layer calls, routed or not: the door's promise.
LAYER_OPS = (
    "mqa_topk_cached",
    "mqa_logits_cached",
    "sparse_attention_cached",
    "mqa_logits",
    "topk_indices",
    "sparse_attention",
    "store_swa_k",
    "pair_pool",
    "compressed_latent",
    "compressed_key",
    "index_key",
    "rope_tail_",
    "rms_norm",
    "apply_rope",
    "rope_index_queries",
    "indexer_weights",
    "candidate_blocks",
    "topk_among_blocks",
    "grouped_wo_a",
    "linear_fp32",
    "fp8_linear",
)


@pytest.mark.parametrize("name", sorted(routing.ROUTES))
def test_kernel_signature_is_the_ops_signature(name: str) -> None:
    op, module = routing.ROUTES[name]
    assert op is getattr(ops, name)
    kernel = routing.kernel_of(name)
    assert kernel.__module__ == module
    assert inspect.signature(kernel) == inspect.signature(op)
    routed = getattr(routing, name)
    assert inspect.signature(routed) == inspect.signature(op)
    assert routed.__doc__ == op.__doc__ and routed.__name__ == name


def test_door_exports_every_layer_op() -> None:
    for name in LAYER_OPS:
        assert callable(getattr(routing, name)), name
        assert name in routing.__all__, name
    for name in set(LAYER_OPS) - set(routing.ROUTES):
        assert getattr(routing, name) is getattr(ops, name), name


def test_cpu_goes_to_ops() -> None:
    torch.manual_seed(0)
    q, w, k = torch.randn(5, 4, 64), torch.randn(5, 4), torch.randn(30, 64)
    nv = torch.tensor([0, 3, 30, 8, 12])
    logits = routing.mqa_logits(q, w, k, nv)
    assert torch.equal(logits, ops.mqa_logits(q, w, k, nv))
    assert torch.equal(routing.topk_indices(logits, nv, 8), ops.topk_indices(logits, nv, 8))
    kv, idx, sink = torch.randn(30, 64), torch.randint(-1, 30, (5, 9)), torch.randn(4)
    assert torch.equal(
        routing.sparse_attention(q, kv, idx, sink, 0.1), ops.sparse_attention(q, kv, idx, sink, 0.1)
    )
    x, pos = torch.randn(5, 64).bfloat16(), torch.arange(5)
    assert torch.equal(
        routing.swa_key(x, pos, None, 1e-6, 16, 1e4), ops.swa_key(x, pos, None, 1e-6, 16, 1e4)
    )
    # Keyword-only calls route on the op's first parameter.
    assert torch.equal(
        routing.pair_pool(kv=x, gate=x, partner_kv=x, partner_gate=x), ops.pair_pool(x, x, x, x)
    )


def test_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(routing.ENV_FLAG, "torch")
    assert not routing.kernel_backend_requested()
    monkeypatch.setenv(routing.ENV_FLAG, "triton")
    assert routing.kernel_backend_requested()
    monkeypatch.setenv(routing.ENV_FLAG, "cuda")
    with pytest.raises(ValueError, match="DSV4CP_KERNELS"):
        routing.kernel_backend_requested()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_with_torch_flag_uses_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    import dsv4cp.kernels.topk as topk_module

    def boom(*args, **kwargs):
        raise AssertionError("the kernel ran although DSV4CP_KERNELS=torch")

    monkeypatch.setattr(topk_module, "topk_indices", boom)
    monkeypatch.setenv(routing.ENV_FLAG, "torch")
    logits = torch.randn(3, 50, device="cuda")
    nv = torch.tensor([50, 10, 0], device="cuda")
    assert torch.equal(routing.topk_indices(logits, nv, 8), ops.topk_indices(logits, nv, 8))
    monkeypatch.setenv(routing.ENV_FLAG, "triton")
    with pytest.raises(AssertionError, match="kernel ran"):
        routing.topk_indices(logits, nv, 8)


def test_shape_limits_name_the_limit() -> None:
    q, w = torch.randn(2, 4, 96).bfloat16(), torch.randn(2, 4)
    with pytest.raises(ValueError, match="D_I must be a power of two"):
        check_mqa_logits(q, w, torch.randn(9, 96).bfloat16(), torch.ones(2))
    with pytest.raises(ValueError, match="H_I must be in"):
        check_mqa_logits(
            torch.randn(2, 200, 64), torch.randn(2, 200), torch.randn(9, 64), torch.ones(2)
        )
    with pytest.raises(ValueError, match="k must be in"):
        check_topk(torch.randn(2, 9), torch.ones(2), 5000)
    with pytest.raises(ValueError, match="logits must be fp32 or bf16"):
        check_topk(torch.randn(2, 9).half(), torch.ones(2), 4)
    check_topk(torch.randn(2, 9).bfloat16(), torch.ones(2), 4)  # bf16 logits are taken
    with pytest.raises(ValueError, match="D must be in"):
        check_sparse_attention(
            torch.randn(2, 4, 1024),
            torch.randn(3, 1024),
            torch.zeros(2, 3, dtype=torch.int32),
            torch.zeros(4),
        )


def test_routes_off_sends_named_routes_to_their_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4CP_KERNELS_OFF names routes that run their ops twin on CUDA (bisecting a mismatch)."""
    from types import SimpleNamespace

    cuda_like: Any = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv(routing.ENV_FLAG, raising=False)
    monkeypatch.setenv(routing.OFF_FLAG, "fp8_linear, sparse_attention_cached")
    assert routing.routes_off() == {"fp8_linear", "sparse_attention_cached"}
    assert not routing.use_kernels(cuda_like, "fp8_linear")
    assert routing.use_kernels(cuda_like, "swa_key") and routing.use_kernels(cuda_like)
    monkeypatch.setenv(routing.OFF_FLAG, "fp8_linear,no_such_route")
    with pytest.raises(ValueError, match="no_such_route"):
        routing.routes_off()


def test_flags_are_parsed_once_per_value_and_a_changed_value_takes_effect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both flags are read on every routed call but parsed once per raw value: a repeated value
    is a cache hit, a changed one (a test's monkeypatch, say) is seen at the next call."""
    from types import SimpleNamespace

    cuda_like: Any = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv(routing.ENV_FLAG, raising=False)
    monkeypatch.setenv(routing.OFF_FLAG, "swa_key")
    assert routing.routes_off() == {"swa_key"}
    hits = env_vars._parse.cache_info().hits
    assert routing.routes_off() == {"swa_key"}
    assert env_vars._parse.cache_info().hits == hits + 1
    assert not routing.use_kernels(cuda_like, "swa_key")
    assert routing.use_kernels(cuda_like, "fp8_linear")
    monkeypatch.setenv(routing.OFF_FLAG, "fp8_linear")
    assert routing.routes_off() == {"fp8_linear"}
    assert routing.use_kernels(cuda_like, "swa_key")
    assert not routing.use_kernels(cuda_like, "fp8_linear")
    monkeypatch.delenv(routing.OFF_FLAG)
    assert routing.routes_off() == frozenset()
    assert routing.use_kernels(cuda_like, "fp8_linear")

    monkeypatch.setenv(routing.ENV_FLAG, "torch")
    assert not routing.use_kernels(cuda_like, "fp8_linear")
    hits = env_vars._parse.cache_info().hits
    assert not routing.kernel_backend_requested()
    assert env_vars._parse.cache_info().hits == hits + 1
    monkeypatch.setenv(routing.ENV_FLAG, "Triton ")
    assert routing.use_kernels(cuda_like, "fp8_linear")
    for _ in range(2):  # a bad value raises on every call, not only the first
        monkeypatch.setenv(routing.ENV_FLAG, "cuda")
        with pytest.raises(ValueError, match="DSV4CP_KERNELS must be"):
            routing.use_kernels(cuda_like)
        monkeypatch.setenv(routing.OFF_FLAG, "nope")
        monkeypatch.setenv(routing.ENV_FLAG, "triton")
        with pytest.raises(ValueError, match="unknown routes"):
            routing.routes_off()
        monkeypatch.delenv(routing.OFF_FLAG)
