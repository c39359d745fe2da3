"""The whole model on CUDA: the GPU path (routed Triton kernels, `grouped_mm` experts, Engram rows
read from the host memmap) against the torch path and against DeepSeek's reference outputs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.cp.launch import run_cp
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.tools.path_check import compare_paths, torch_path
from dsv4cp.tools.reference_check import block_agreement, logits_agreement
from tests.model import test_whole_model_reference as composition

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _logits(model: DeepseekV41Model, prompt: list[int], *, torch_twins: bool) -> torch.Tensor:
    with torch_path(model) if torch_twins else contextlib.nullcontext():
        runner = PrefillRunner(model, num_slots=1024, max_context=512)
        out = runner.prefill({"a": prompt}, return_all_logits=True).all_logits
    assert out is not None
    return out.cpu()


def test_tiny_full_gpu_path_equals_torch_path_fp32() -> None:
    model = DeepseekV41Model(DeepseekV41Config.tiny_full(), device="cuda", seed=3)
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    fast = _logits(model, prompt, torch_twins=False)
    ref = _logits(model, prompt, torch_twins=True)
    got = logits_agreement(fast, ref)
    assert got["rms_rel"] <= 1e-4 and got["top1_agree"] >= 0.98, got  # TF32-free fp32


def test_tiny_full_gpu_path_equals_torch_path_bf16() -> None:
    """bf16: the two paths round differently, and one rounding at a selection's cut flips a
    token's experts (an O(1) change of its MoE output); run end to end, later blocks carry it
    (measured on the H200: logits 15.5 % rms, top-1 89 % over 300 tokens). So the GPU path is
    judged teacher-forced on the torch path's record (`tools.path_check`): every block >= 95 %
    of tokens agreeing (in `none` bf16: within 1e-2 relative rms per token, the attention
    kernels' bf16 inputs), top-k up to ties."""
    model = DeepseekV41Model(
        DeepseekV41Config.tiny_full(), dtype=torch.bfloat16, device="cuda", seed=3
    )
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    res = compare_paths(model, prompt)
    assert res["pass"], {k: res[k] for k in ("blocks", "topk", "logits")}


def test_fixture_gpu_path_equals_torch_path_qat() -> None:
    """The released-format fixture in qat, bf16: the GPU path (Triton fp8/fp4 kernels) against
    the torch twins, teacher-forced, on the reference's own prompt."""
    model = DeepseekV41Model.from_checkpoint(
        str(composition.fx.CHECKPOINT), quant="qat", dtype=torch.bfloat16, device="cuda"
    )
    ids = composition.ref("input_ids").long().flatten().tolist()
    res = compare_paths(model, ids)
    assert res["pass"], {k: res[k] for k in ("blocks", "topk", "logits")}


@pytest.fixture(scope="module")
def cuda_composed() -> dict[str, torch.Tensor]:
    """The fixture model on CUDA, everything but the attention in qat (the attention's output
    forced from the reference: tests/model/test_whole_model_reference.py); the Engram tables
    stay host memmaps. Free-running."""
    return composition.run_composed(SingleCPGroup(), (61,), device="cuda")


@pytest.fixture(scope="module")
def cuda_composed_forced() -> dict[str, torch.Tensor]:
    """The same, every block teacher-forced on the reference's previous block."""
    return composition.run_composed(SingleCPGroup(), (61,), device="cuda", forced=True)


@pytest.mark.parametrize("i", range(7))
def test_composition_on_cuda_matches_the_reference(cuda_composed_forced, i: int) -> None:
    # teacher-forced, at reference-check's 2 ulps: the CUDA fp32 GEMMs (the mix logits, the
    # gate) sum in another order than the reference's, Sinkhorn's 20 rounds carry that into
    # the mixes, and one bf16 rounding of a stream moves either way. Free-running, a token that
    # moved stays moved: measured on the H200, blocks 3-6 at 57/61 within 2 ulps (the same 4
    # tokens, from blocks 0 and 2 on), which the logits test below bounds end to end.
    got = block_agreement(
        cuda_composed_forced[f"layer{i}"], composition.ref(f"block{i}.out"), ulps=2
    )
    assert got["tf_token_agree"] >= composition.TOKEN_SHARE, (i, got)
    assert got["rms_rel"] <= composition.RMS_REL, (i, got)


def test_composition_logits_on_cuda(cuda_composed) -> None:
    got = logits_agreement(cuda_composed["logits"], composition.ref("full_logits"))
    # 2e-3: the blocks' bound doubled with their ulps (1 → 2, above); measured 1.03e-3, top-1
    # 61/61 on the H200 (CPU holds 1e-3, tests/model/test_whole_model_reference.py)
    assert got["rms_rel"] <= 2e-3 and got["top1_agree"] >= 60 / 61, got


def test_tiny_full_cp4_fake_on_one_gpu_equals_cp1() -> None:
    cfg = DeepseekV41Config.tiny_full()
    prompt = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()

    def rank(group):  # noqa: ANN001, ANN202
        model = DeepseekV41Model(cfg, device="cuda", seed=4)
        runner = PrefillRunner(model, cp=group, num_slots=512, max_context=256)
        return runner.prefill({"a": prompt}, return_all_logits=True).all_logits.cpu()

    one = rank(SingleCPGroup())
    four = run_cp(4, rank, backend="fake")[0]
    assert logits_agreement(four, one)["rms_rel"] <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_full_graph_replay_equals_eager(dtype: str) -> None:
    """mHC and the MoE under breakable CUDA graphs: no host sync in the captured forward (the
    experts' masked backend in fp32, one grouped_mm chunk in bf16; counts by scatter-add)."""
    from dsv4cp.graphs.runner import GraphConfig

    model = DeepseekV41Model(
        DeepseekV41Config.tiny_full(), dtype=getattr(torch, dtype), device="cuda", seed=6
    )
    gcfg = GraphConfig(buckets=(64,), max_requests=2, max_context=256)
    graphs = PrefillRunner(model, num_slots=1024, max_context=512, graphs=gcfg)
    eager = PrefillRunner(model, num_slots=1024, max_context=512)
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    for runner in (graphs, eager):
        runner.prefill({"a": prompt[:60]})
    a = graphs.prefill({"a": prompt[60:]}, return_all_logits=True).all_logits
    b = eager.prefill({"a": prompt[60:]}, return_all_logits=True).all_logits
    assert graphs.graph_runner is not None and graphs.graph_runner.fallbacks == 0
    limit = 1e-4 if dtype == "float32" else 2e-2
    assert logits_agreement(a.cpu(), b.cpu())["rms_rel"] <= limit
