"""The GPU path (routed Triton kernels, grouped experts) against the torch path (the `ops/` twins,
the experts' loop), judged the way `reference-check` judges a checkpoint against DeepSeek's
outputs: teacher-forced per block.

One forward through the torch path records every block's output streams, the `pre` each block
received and the index layers' top-k, in the reference file's layout
(`tools.reference_check`). The GPU path then runs teacher-forced on that record: block i gets the
torch path's block i−1 output, so a bf16 rounding that flips one discrete choice (a token's
experts, an index entry at the top-k cut) costs that token in that block only instead of being
carried, compounded, into every later block. End-to-end logits are reported beside it.

What "agrees" means per token depends on the numerics. In `qat` the twins emulate the
reference's bf16 steps, so both paths round at the same places: reference-check's 2 bf16 ulps
per element. In `none` with bf16 activations the twins compute the attention in fp32 while the
kernels (the Triton attention, FlashMLA) round q, k and the probabilities to bf16 for the tensor
cores: every element moves by about one bf16 rounding of its inputs, and elements near zero by
many of their own ulps (measured on the H200, tiny_full, 300 tokens: per-token relative rms
median 4.5e-3, max 6.4e-3 in block 0; the attention kernels off, 0). There a token agrees when
its relative rms difference is within `NONE_BF16_TOKEN_RMS`."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.tools.reference_check import (
    RID,
    Criteria,
    TeacherForcing,
    logits_agreement,
    teacher_forced,
)

__all__ = [
    "NONE_BF16_TOKEN_RMS",
    "compare_paths",
    "record_reference",
    "single_request_runner",
    "token_rms_agreement",
    "torch_path",
]

NONE_BF16_TOKEN_RMS = 1e-2  # 2.56 bf16 epsilons: one rounding of the attention's inputs


@contextmanager
def torch_path(model: DeepseekV41Model) -> Iterator[None]:
    """The torch twins everywhere: DSV4CP_KERNELS=torch and the experts' loop backend."""
    old = os.environ.get("DSV4CP_KERNELS")
    os.environ["DSV4CP_KERNELS"] = "torch"
    model.set_moe_backend("loop")
    try:
        yield
    finally:
        model.set_moe_backend("auto")
        if old is None:
            del os.environ["DSV4CP_KERNELS"]
        else:
            os.environ["DSV4CP_KERNELS"] = old


class _Recorder(TeacherForcing):
    """TeacherForcing with nothing to force: records each block's `pre` as well."""

    def block_input(
        self, i: int, h: Tensor, pre: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor | None]:
        if pre is not None:
            self.local[f"pre{i}"] = pre.detach().clone()
        return h, pre


def token_rms_agreement(ours: Tensor, ref: Tensor, bound: float) -> dict[str, float]:
    """ours / ref [T, ...]: share of tokens whose ‖ours − ref‖ / ‖ref‖ is within `bound`."""
    diff = ours.float() - ref.float()
    per_token = diff.flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1).clamp_min(1e-30)
    return {
        "tf_token_agree": (per_token <= bound).float().mean().item(),
        "max_abs": diff.abs().max().item(),
        "rms_rel": (diff.norm() / ref.float().norm().clamp_min(1e-30)).item(),
        "token_rms_rel_max": per_token.max().item(),
    }


def single_request_runner(model: DeepseekV41Model, tokens: int) -> PrefillRunner:
    """A runner sized for one request of `tokens` tokens (and a spare row)."""
    return PrefillRunner(model, num_slots=tokens + 64, max_requests=2, max_context=tokens + 16)


def record_reference(model: DeepseekV41Model, ids: list[int]) -> dict[str, Tensor]:
    """One prefill of `ids` in the active path, as a reference file: `input_ids`,
    `full_logits`, per block `block{i}.out`, `block{i}.pre_mix_in`, and `block{i}.topk` of index
    layers (entry + T, −1 none, the reference's convention); also `hidden` [1, T, d], the final
    hidden rows (fp32)."""
    if not ids:
        raise ValueError("record_reference: no tokens")
    t = len(ids)
    rec = _Recorder(model, {})
    with rec.installed():
        out = single_request_runner(model, t).prefill({RID: ids}, return_all_logits=True)
        rec.flush()
    assert out.all_logits is not None
    ref: dict[str, Tensor] = {
        "input_ids": torch.tensor([ids]),
        "full_logits": out.all_logits.float().cpu()[None],
        "hidden": out.hidden.float().cpu()[None],
    }
    for block in model.blocks:
        i = block.layer
        ref[f"block{i}.out"] = rec.result(f"layer{i}")[None]
        if f"pre{i}" in rec.rows:
            ref[f"block{i}.pre_mix_in"] = rec.result(f"pre{i}")[None]
        if f"topk{i}" in rec.rows:
            top = rec.result(f"topk{i}").long()
            ref[f"block{i}.topk"] = torch.where(top >= 0, top + t, -1)[None]
    return ref


def compare_paths(
    model: DeepseekV41Model,
    ids: list[int],
    crit: Criteria | None = None,
    ref: dict[str, Tensor] | None = None,
) -> dict[str, Any]:
    """The GPU path teacher-forced on the torch path's record of `ids` (CP 1, one shot; `ref`:
    that record when the caller has made it, `record_reference` under `torch_path`):
    per block `tf_token_agree` / `max_abs` / `rms_rel`, per index layer the top-k match up to
    ties, end-to-end logits; `pass` by `crit`'s shares (reference-check's by default), a token
    agreeing by `crit.ulps` or, for `none` in bf16, by `NONE_BF16_TOKEN_RMS` (module doc)."""
    crit = crit or Criteria()
    rule = f"{crit.ulps} bf16 ulps"
    agreement = None
    if model.quant == "none" and model.dtype == torch.bfloat16:
        rule = f"token_rms_rel<={NONE_BF16_TOKEN_RMS}"
        agreement = functools.partial(token_rms_agreement, bound=NONE_BF16_TOKEN_RMS)
    with torch.inference_mode():
        if ref is None:
            with torch_path(model):
                ref = record_reference(model, ids)
        blocks, topk = teacher_forced(model, ref, SingleCPGroup(), 0, crit, agreement)
        runner = single_request_runner(model, len(ids))
        logits = runner.prefill({RID: ids}, return_all_logits=True).all_logits
    assert logits is not None
    e2e = logits_agreement(logits.float().cpu(), ref["full_logits"][0])
    ok = all(b["tf_token_agree"] >= crit.block_share for b in blocks) and all(
        k["match_share"] >= crit.topk_share for k in topk
    )
    return {
        "tokens": len(ids),
        "token_rule": rule,
        "blocks": blocks,
        "topk": topk,
        "logits": e2e,
        "pass": ok,
    }
