"""Routing: CPU → ops, CUDA → kernel unless DSV4CP_KERNELS=torch, and the kernels' shape limits."""

from __future__ import annotations

import pytest
import torch

import dsv4cp.kernels as kernels
from dsv4cp import ops
from dsv4cp.kernels import dispatch
from dsv4cp.kernels.mqa_logits import check_mqa_logits
from dsv4cp.kernels.sparse_attention import check_sparse_attention
from dsv4cp.kernels.topk import check_topk


def test_package_names_are_the_routed_functions() -> None:
    assert kernels.mqa_logits is dispatch.mqa_logits
    assert kernels.sparse_attention is dispatch.sparse_attention


def test_cpu_goes_to_ops() -> None:
    torch.manual_seed(0)
    q, w, k = torch.randn(5, 4, 64), torch.randn(5, 4), torch.randn(30, 64)
    nv = torch.tensor([0, 3, 30, 8, 12])
    logits = kernels.mqa_logits(q, w, k, nv)
    assert torch.equal(logits, ops.mqa_logits(q, w, k, nv))
    assert torch.equal(kernels.topk_indices(logits, nv, 8), ops.topk_indices(logits, nv, 8))
    assert torch.equal(kernels.mqa_topk(q, w, k, nv, 8, max_logits_bytes=2 * 30 * 4),
                       ops.topk_indices(logits, nv, 8))
    kv, idx, sink = torch.randn(30, 64), torch.randint(-1, 30, (5, 9)), torch.randn(4)
    assert torch.equal(kernels.sparse_attention(q, kv, idx, sink, 0.1),
                       ops.sparse_attention(q, kv, idx, sink, 0.1))
    x, pos = torch.randn(5, 64).bfloat16(), torch.arange(5)
    assert torch.equal(kernels.swa_key(x, pos, None, 1e-6, 16, 1e4),
                       ops.swa_key(x, pos, None, 1e-6, 16, 1e4))
    c1, c2 = torch.zeros(8, 64), torch.zeros(8, 64)
    slots = torch.tensor([7, 1, 2, 3, 5])
    latent = kernels.compress_store(x, None, None, None, pos, slots, c1, None, 1e-6, 16, 1e4)
    ref_latent = ops.compressed_latent(x, None, 1e-6, torch.float32)
    c2[slots] = ops.compressed_key(ref_latent, pos, 16, 1e4)
    assert torch.equal(latent, ref_latent) and torch.equal(c1, c2)


def test_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_FLAG, "torch")
    assert not dispatch.kernel_backend_requested()
    monkeypatch.setenv(dispatch.ENV_FLAG, "triton")
    assert dispatch.kernel_backend_requested()
    monkeypatch.setenv(dispatch.ENV_FLAG, "cuda")
    with pytest.raises(ValueError, match="DSV4CP_KERNELS"):
        dispatch.kernel_backend_requested()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_with_torch_flag_uses_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    import dsv4cp.kernels.topk as topk_module

    def boom(*args, **kwargs):
        raise AssertionError("the kernel ran although DSV4CP_KERNELS=torch")

    monkeypatch.setattr(topk_module, "topk_indices", boom)
    monkeypatch.setenv(dispatch.ENV_FLAG, "torch")
    logits = torch.randn(3, 50, device="cuda")
    nv = torch.tensor([50, 10, 0], device="cuda")
    assert torch.equal(dispatch.topk_indices(logits, nv, 8), ops.topk_indices(logits, nv, 8))
    monkeypatch.setenv(dispatch.ENV_FLAG, "triton")
    with pytest.raises(AssertionError, match="kernel ran"):
        dispatch.topk_indices(logits, nv, 8)


def test_shape_limits_name_the_limit() -> None:
    q, w = torch.randn(2, 4, 96).bfloat16(), torch.randn(2, 4)
    with pytest.raises(ValueError, match="D_I must be a power of two"):
        check_mqa_logits(q, w, torch.randn(9, 96).bfloat16(), torch.ones(2))
    with pytest.raises(ValueError, match="H_I must be in"):
        check_mqa_logits(torch.randn(2, 200, 64), torch.randn(2, 200), torch.randn(9, 64),
                         torch.ones(2))
    with pytest.raises(ValueError, match="k must be in"):
        check_topk(torch.randn(2, 9), torch.ones(2), 5000)
    with pytest.raises(ValueError, match="logits must be fp32"):
        check_topk(torch.randn(2, 9).bfloat16(), torch.ones(2), 4)
    with pytest.raises(ValueError, match="D must be in"):
        check_sparse_attention(torch.randn(2, 4, 1024), torch.randn(3, 1024),
                               torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4))
