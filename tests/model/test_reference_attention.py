"""The V4.1 attention under quant="qat" against DeepSeek's reference outputs, teacher-forced.

Every layer of the tiny released-format checkpoint loads its attention weights through
`CheckpointReader` / `load_into` (fp8 + e8m0 block scales, `wo_a` dequantized) and runs in bf16 on
`block{i}.attn_in`; the compressed and index keys, top-k and candidate blocks later layers read
come from our own earlier layers, run the same way (one prefill of the 61-token prompt). Outputs
are compared with `block{i}.attn_out`, selections with `block{1,3,5}.topk`.

Tolerance: an element agrees when it is within one bf16 ulp of the reference (the reference is
defined only up to fp32 summation order, kernel_cpu.py), a token when all 128 of its elements do.
Goal: >= 95% of the tokens of every layer. Measured (docs/quantization.md): every token of
layers 0, 1, 2, 5, 6 bit-identical; layers 3 and 4 differ at one token (position 49), where the
reference's `torch.topk` broke a tie at the cut the other way than our smaller-index rule (layer
4 reuses layer 3's selection). The tests below check exactly that explanation: selections equal
up to ties, and with the reference's selections substituted every token of every layer agrees.
quant="none" on the same weights misses the tolerance in every layer (the test has power).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

import dsv4cp.layers.attention as attention_module
from dsv4cp import routing
from dsv4cp.config import DeepseekV41Config
from tests.model import dsv41_fixture as fx
from tests.model.attention_stack import AttentionStack, load_attention, run_teacher_forced

N_LAYERS = 7
INDEX_LAYERS = (1, 3, 5)
TOKEN_SHARE = 0.95


class Agreement(NamedTuple):
    token_share: float  # tokens with every element within 1 bf16 ulp of the reference
    bad_tokens: list[int]
    max_abs: float
    rms_rel: float


def agreement(ours: Tensor, ref: Tensor) -> Agreement:
    diff = (ours.float() - ref).abs()
    ok = (diff <= fx.ulp_bf16(ref)).all(dim=1)
    bad = (~ok).nonzero().flatten().tolist()
    rms = (diff.norm() / ref.norm()).item()
    return Agreement(ok.float().mean().item(), bad, diff.max().item(), rms)


def ref(key: str) -> Tensor:
    return fx.reference()[key][0]


def ref_topk(layer: int) -> Tensor:
    """The reference's selection as compressed entry indices: `Indexer.forward` returns them
    shifted by the window KV length (the prompt length in a one-shot prefill), -1 kept."""
    t = ref(f"block{layer}.topk")
    return torch.where(t >= 0, t - t.shape[0], -1)


class Run(NamedTuple):
    out: dict[str, Tensor]
    logits: list[Tensor]  # the index scores of layers 1, 3, 5, in order


@functools.lru_cache(maxsize=None)
def teacher_forced(quant: str, reference_topk: bool = False, device: str = "cpu") -> Run:
    cfg = DeepseekV41Config.from_hf(fx.CHECKPOINT)
    layers = [
        load_attention(cfg, fx.reader(), i, quant=quant, device=device) for i in range(N_LAYERS)
    ]
    inputs = {i: ref(f"block{i}.attn_in").to(device, torch.bfloat16) for i in range(N_LAYERS)}
    logits: list[Tensor] = []
    queue = [ref_topk(i).to(device) for i in INDEX_LAYERS]
    mp = pytest.MonkeyPatch()
    real_select = attention_module.mqa_topk_cached

    def recording_select(q: Tensor, w: Tensor, k_cache: Tensor, k_rows: Tensor, n_vis: Tensor,
                         k_top: int, **kw: Any) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        # the layer's index node is one op: record its scores, keep its candidate blocks, and
        # take the reference's top-k where asked
        logits.append(
            routing.mqa_logits_cached(  # the kernel on CUDA, as the layer's scores were
                q, w, k_cache, k_rows, n_vis, k_start=kw["k_start"], width=kw["width"],
                k_format=kw["k_format"], quant=kw["quant"],
            ).cpu()
        )  # fmt: skip
        top, blocks = real_select(q, w, k_cache, k_rows, n_vis, k_top, **kw)
        if reference_topk:
            picked = queue.pop(0)
            assert picked.shape[0] == top.shape[0], "one call per index layer"
            top = picked.to(torch.int32)
        return top, blocks

    with mp.context() as m:
        m.setattr(attention_module, "mqa_topk_cached", recording_select)
        stack = AttentionStack(cfg, layers, device=device)
        ids = fx.reference()["input_ids"][0].tolist()
        out = stack.step({"a": ids}, run_teacher_forced(layers, inputs))
    assert len(logits) == len(INDEX_LAYERS)
    return Run(out, logits)


def tie_rows(layer: int, device: str = "cpu") -> list[int]:
    """Rows whose selection differs from the reference's; asserts each differs only by entries
    whose scores tie at the cut (the k-th largest visible score)."""
    run = teacher_forced("qat", device=device)
    ours, theirs = run.out[f"topk{layer}"], ref_topk(layer)
    scores = run.logits[INDEX_LAYERS.index(layer)]
    k = ours.shape[1]
    rows = []
    for r in range(ours.shape[0]):
        a, b = set(ours[r].tolist()) - {-1}, set(theirs[r].tolist()) - {-1}
        if a == b:
            continue
        rows.append(r)
        assert len(a) == len(b), f"layer {layer} row {r}: {sorted(a)} vs {sorted(b)}"
        visible = scores[r][torch.isfinite(scores[r])]
        cut = visible.sort(descending=True).values[k - 1]
        tied = {j: scores[r, j].item() for j in a ^ b}
        assert all(v == cut for v in tied.values()), f"layer {layer} row {r}: {tied} vs {cut}"
    return rows


@pytest.mark.parametrize("layer", INDEX_LAYERS)
def test_topk_equals_the_reference_up_to_ties(layer: int) -> None:
    rows = tie_rows(layer)
    assert len(rows) <= 2, f"layer {layer}: {len(rows)} rows differ by ties"  # summary.json


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_attention_teacher_forced(layer: int) -> None:
    got = agreement(teacher_forced("qat").out[f"attn_out{layer}"], ref(f"block{layer}.attn_out"))
    assert got.token_share >= TOKEN_SHARE, f"layer {layer}: {got}"
    # The rest is explained: tokens whose selection (this layer's top-k source) differs by a tie.
    source = DeepseekV41Config.from_hf(fx.CHECKPOINT).layer_role(layer).topk_from
    explained = set(tie_rows(source)) if source is not None else set()
    assert set(got.bad_tokens) <= explained, f"layer {layer}: {got}, tie rows {explained}"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_attention_teacher_forced_cuda(layer: int) -> None:
    """On CUDA the SWA / compressor / index kernels, the fp8 GEMM kernel and the top-k kernel
    run (tensor-core sums instead of exact block sums): the same goal, >= 95% of the tokens,
    selections equal up to ties."""
    got = agreement(
        teacher_forced("qat", device="cuda").out[f"attn_out{layer}"], ref(f"block{layer}.attn_out")
    )
    assert got.token_share >= TOKEN_SHARE, f"layer {layer}: {got}"
    if layer in INDEX_LAYERS:
        assert len(tie_rows(layer, "cuda")) <= 2


def test_with_the_references_selections_every_token_agrees() -> None:
    run = teacher_forced("qat", reference_topk=True)
    for layer in range(N_LAYERS):
        got = agreement(run.out[f"attn_out{layer}"], ref(f"block{layer}.attn_out"))
        assert got.token_share == 1.0, f"layer {layer}: {got}"


def test_exact_math_mode_is_not_the_reference() -> None:
    """The tolerance has teeth: quant="none" (no fp8/fp4 steps) on the same weights misses it."""
    run = teacher_forced("none")
    for layer in range(N_LAYERS):
        got = agreement(run.out[f"attn_out{layer}"], ref(f"block{layer}.attn_out"))
        assert got.token_share < TOKEN_SHARE, f"layer {layer}: {got}"
