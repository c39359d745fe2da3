"""`dsv4cp reference-check`: a released-format checkpoint against reference outputs one trusts.

The reference file is a safetensors file with the keys of the tiny fixture
(`tests/fixtures/dsv41-tiny-reference/README.md`): `input_ids [1, T]`, `full_logits [1, T, V]`,
and per block `block{i}.out [1, T, H, d]` (the streams after block i), optionally
`block{i}.pre_mix_in [1, T, H]`, `block{i}.topk [1, T, K]` (index layers: compressed entry + T,
−1 none: the reference lists its window rows first) and `decoded_ids` / `decode_logits`.

Two runs of the checkpoint on `input_ids`, through `PrefillRunner` (chunked with `chunk`, on `cp`
ranks through the CP launcher):

1. Teacher-forced: block i gets the reference's `block{i-1}.out` (block 0 the embedding; the
   `pre` handed over from `block{i}.pre_mix_in` when present) and its output is compared with
   `block{i}.out` token by token: a token agrees when every element is within `ulps` bf16 ulps
   of the reference. Index layers' selections are compared with `block{i}.topk` as sets; a
   mismatch only at the selection boundary where our own scores tie counts as a match ("up to
   ties"). Cross-layer state (caches, top-k, candidates) comes from the earlier blocks run the
   same way.
2. End to end: one plain prefill; `full_logits` relative rms and top-1 agreement. Decode steps
   are fed the reference's own tokens and reported, not judged: against `decode_logits` (the
   reference's decode path, which differs from its own prefill by its batching sensitivity,
   `summary.json`) and, last step, against `prefill_of_decoded_logits` (one-shot vs one-shot:
   our decode steps extend the prefill exactly).

Pass (`Criteria`, docs/model.md): every block's share of agreeing tokens and every index layer's
top-k match share at least their minimum, logits within their rms and top-1 bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, SingleCPGroup, gather_global
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.tools.reference_file import (
    check_model_fits,
    load_reference,
    reference_sensitivity,
)

RID = "reference"


@dataclass(frozen=True)
class Criteria:
    """What `pass` means (docs/model.md, "reference-check")."""

    ulps: float = 2.0  # an element agrees within this many bf16 ulps of the reference
    block_share: float = 0.95  # minimum share of agreeing tokens per block
    topk_share: float = 0.95  # minimum share of queries whose top-k matches up to ties
    logits_rms_rel: float = 0.05  # maximum ‖ours − ref‖ / ‖ref‖ of full_logits
    logits_top1: float = 0.9  # minimum share of positions with the same top-1 token

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not (v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"reference-check: {name} must be a finite number >= 0, got {v}")
        for name in ("block_share", "topk_share", "logits_top1"):
            if getattr(self, name) > 1:
                raise ValueError(f"reference-check: {name} is a share in [0, 1]")


@dataclass(frozen=True)
class CheckRun:
    checkpoint: str
    reference: str
    cp: int = 1
    backend: str = "fake"
    chunk: int = 0  # 0: one-shot prefill
    quant: str = "qat"
    dtype: str = "bfloat16"
    device: str = "cpu"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"reference-check: cp must be >= 1, got {self.cp}")
        if self.chunk < 0:
            raise ValueError(
                f"reference-check: chunk must be >= 0 (0: one chunk), got {self.chunk}"
            )
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError("reference-check: timeout must be a positive number of seconds")


# ---------------------------------------------------------------------------- agreement
def ulp_bf16(x: Tensor) -> Tensor:
    """One bf16 unit in the last place of |x| (2^(exponent - 7); the smallest normal's below)."""
    _, exp = torch.frexp(x.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - 8)


def block_agreement(ours: Tensor, ref: Tensor, ulps: float) -> dict[str, float]:
    """ours / ref [T, ...]: share of tokens whose every element is within `ulps` bf16 ulps."""
    diff = (ours.float() - ref.float()).abs()
    ok = (diff <= ulps * ulp_bf16(ref)).flatten(1).all(dim=1)
    return {
        "tf_token_agree": ok.float().mean().item(),
        "max_abs": diff.max().item(),
        "rms_rel": (diff.norm() / ref.float().norm().clamp_min(1e-30)).item(),
    }


def topk_agreement(ours: Tensor, scores: Tensor, ref: Tensor) -> dict[str, float]:
    """Per query, our top-k entries [T, K] (−1 none) against the reference's [T, K'] as sets; a
    query whose sets differ only by entries whose (our) score equals our k-th best score is a
    match up to ties. scores [T, width] are our index scores."""
    exact = tied = 0
    n = ours.shape[0]
    for t in range(n):
        a = {int(e) for e in ours[t] if e >= 0}
        b = {int(e) for e in ref[t] if e >= 0}
        if a == b:
            exact += 1
            continue
        if not a or max(a | b) >= scores.shape[1]:
            continue
        kth = min(scores[t, e].item() for e in a)
        if all(scores[t, e].item() == kth for e in a ^ b):
            tied += 1
    return {"match_share": (exact + tied) / n, "exact_share": exact / n, "tie_matches": tied}


def logits_agreement(ours: Tensor, ref: Tensor) -> dict[str, float]:
    diff = ours.float() - ref.float()
    return {
        "rms_rel": (diff.norm() / ref.float().norm().clamp_min(1e-30)).item(),
        "top1_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "max_abs": diff.abs().max().item(),
    }


# ---------------------------------------------------------------------------- teacher forcing
class TeacherForcing:
    """Model hooks for teacher-forced forwards: block i's input replaced by the reference's
    `block{i-1}.out` rows (and `pre` by `block{i}.pre_mix_in`), every block's output rows, the
    top-k and the index scores of index layers recorded; `flush` gathers a forward's rows."""

    def __init__(self, model: DeepseekV41Model, ref: dict[str, Tensor]) -> None:
        self.model, self.ref = model, ref
        self.local: dict[str, Tensor] = {}
        self.rows: dict[str, list[Tensor]] = {}
        self.ctx: ForwardContext | None = None
        self.attn_in: dict[int, Tensor] = {}

    def _rows(self, key: str, ctx: ForwardContext, like: Tensor) -> Tensor:
        return self.ref[key][0][ctx.local.positions.cpu()].to(like.device, like.dtype)

    def block_input(
        self, i: int, h: Tensor, pre: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor | None]:
        if i > 0 and f"block{i - 1}.out" in self.ref:
            h = self._rows(f"block{i - 1}.out", ctx, h)
        key = f"block{i}.pre_mix_in"
        if pre is not None and key in self.ref:
            pre = self._rows(key, ctx, pre)
        return h, pre

    def layer_out(self, name: str, h: Tensor, ctx: ForwardContext) -> None:
        self.ctx = ctx
        self.local[name] = h.detach().clone()
        layer = int(name.removeprefix("layer"))
        role = self.model.blocks[layer].attn.role
        if role.index_source:
            self.local[f"topk{layer}"] = ctx.cross.topk[role.ratio].clone()
            scores = self.model.index_scores(layer, self.attn_in.pop(layer), ctx)
            self.local[f"scores{layer}"] = scores

    @contextmanager
    def installed(self) -> Iterator[TeacherForcing]:
        model = self.model
        handles = []
        for block in model.blocks:
            if block.attn.role.index_source:
                keep = functools.partial(self._keep_attn_in, block.layer)
                handles.append(block.attn.register_forward_pre_hook(keep))
        model.block_input_hook, model.layer_hook = self.block_input, self.layer_out
        try:
            yield self
        finally:
            model.block_input_hook = model.layer_hook = None
            for handle in handles:
                handle.remove()

    def _keep_attn_in(self, layer: int, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.attn_in[layer] = args[0].detach()

    def flush(self) -> None:
        """Gather this forward's local rows to global rows (collectives: every rank calls)."""
        ctx = self.ctx
        if ctx is None:
            raise ValueError("TeacherForcing.flush: no forward ran with the hooks installed")
        width = max(
            (t.shape[1] for k, t in self.local.items() if k.startswith("scores")), default=0
        )
        for key, t in sorted(self.local.items()):
            if key.startswith("scores"):  # widths grow with the context: pad to one width
                pad = t.new_full((t.shape[0], width - t.shape[1]), float("-inf"))
                t = torch.cat([t, pad], dim=1)
            g = gather_global(ctx.cp, ctx.layout, t, tag=f"reference/{key}")
            self.rows.setdefault(key, []).append(g.cpu())
        self.local.clear()

    def result(self, key: str) -> Tensor:
        parts = self.rows[key]
        if key.startswith("scores"):
            width = max(p.shape[1] for p in parts)
            parts = [
                torch.cat([p, p.new_full((p.shape[0], width - p.shape[1]), float("-inf"))], 1)
                for p in parts
            ]
        return torch.cat(parts)


# ---------------------------------------------------------------------------- the runs
def _runner(model: DeepseekV41Model, tokens: int, cp: CPGroup) -> PrefillRunner:
    return PrefillRunner(
        model, cp=cp, num_slots=16 * (tokens // 16 + 4), max_requests=2, max_context=tokens + 16
    )


def _chunks(ids: list[int], chunk: int) -> list[list[int]]:
    step = chunk or len(ids)
    return [ids[a : a + step] for a in range(0, len(ids), step)]


def teacher_forced(
    model: DeepseekV41Model,
    ref: dict[str, Tensor],
    cp: CPGroup,
    chunk: int,
    crit: Criteria,
    agreement: Callable[[Tensor, Tensor], dict[str, float]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per block agreement (`agreement`, default `block_agreement` at `crit.ulps`) and per
    index layer top-k agreement of a teacher-forced run against `ref`."""
    agree = agreement or functools.partial(block_agreement, ulps=crit.ulps)
    ids = ref["input_ids"][0].tolist()
    runner = _runner(model, len(ids), cp)
    tf = TeacherForcing(model, ref)
    with tf.installed():
        for part in _chunks(ids, chunk):
            runner.prefill({RID: part})
            tf.flush()
    blocks, topk = [], []
    offset = len(ids)  # the reference lists its window rows (one per prompt token) first
    for block in model.blocks:
        i = block.layer
        if f"block{i}.out" in ref:
            got = agree(tf.result(f"layer{i}"), ref[f"block{i}.out"][0])
            blocks.append({"block": i, **got})
        if f"block{i}.topk" in ref and block.attn.role.index_source:
            want = ref[f"block{i}.topk"][0].long()
            want = torch.where(want >= 0, want - offset, -1)
            got = topk_agreement(tf.result(f"topk{i}"), tf.result(f"scores{i}"), want)
            topk.append({"layer": i, **got})
    return blocks, topk


def end_to_end(
    model: DeepseekV41Model, ref: dict[str, Tensor], cp: CPGroup, chunk: int
) -> dict[str, Any]:
    ids = ref["input_ids"][0].tolist()
    runner = _runner(model, len(ids) + 8, cp)
    parts = [
        runner.prefill({RID: p}, return_all_logits=True).all_logits for p in _chunks(ids, chunk)
    ]
    logits = torch.cat([p for p in parts if p is not None]).cpu()
    out: dict[str, Any] = {"logits": logits_agreement(logits, ref["full_logits"][0])}
    decoded, steps = ref.get("decoded_ids"), ref.get("decode_logits")
    if decoded is not None and steps is not None and decoded.shape[-1] == steps.shape[0] + 1:
        ours_first = int(logits[-1].argmax())
        fed = decoded[0].tolist()
        dec = [runner.decode({RID: t}).logits[0].cpu() for t in fed[:-1]]
        out["decode"] = {
            "first_token_agree": ours_first == fed[0],
            **logits_agreement(torch.stack(dec), steps),
        }
        one_shot = ref.get("prefill_of_decoded_logits")
        if one_shot is not None and dec:  # our decode steps extend the prefill exactly
            out["decode"]["vs_prefill_of_decoded"] = logits_agreement(dec[-1], one_shot[0])
    return out


def _rank_main(group: CPGroup, run: CheckRun, crit: Criteria) -> dict[str, Any] | None:
    dtype = getattr(torch, run.dtype)
    model = DeepseekV41Model.from_checkpoint(
        run.checkpoint, quant=run.quant, dtype=dtype, device=run.device
    )
    ref = load_reference(run.reference)
    check_model_fits(model, ref)
    with torch.inference_mode():
        blocks, topk = teacher_forced(model, ref, group, run.chunk, crit)
        e2e = end_to_end(model, ref, group, run.chunk)
    if group.rank != 0:
        return None
    return {"blocks": blocks, "topk": topk, **e2e}


def verdict(report: dict[str, Any], crit: Criteria) -> bool:
    logits = report["logits"]
    return (
        all(b["tf_token_agree"] >= crit.block_share for b in report["blocks"])
        and all(t["match_share"] >= crit.topk_share for t in report["topk"])
        and logits["rms_rel"] <= crit.logits_rms_rel
        and logits["top1_agree"] >= crit.logits_top1
    )


def run_reference_check(
    run: CheckRun,
    crit: Criteria | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The JSON report: `blocks`, `topk`, `logits`, `decode`, `reference_sensitivity`,
    `criteria`, `run`, `pass`."""
    crit = crit or Criteria()
    load_reference(run.reference)  # fail early, before any rank starts
    if progress:
        progress(f"reference-check: {run.checkpoint} on CP={run.cp}, chunk {run.chunk or 'none'}")
    if run.cp == 1:
        report = _rank_main(SingleCPGroup(), run, crit)
    else:
        from dsv4cp.cp.launch import run_cp

        results = run_cp(
            run.cp, _rank_main, run, crit, backend=run.backend, timeout_s=run.timeout_s
        )
        report = results[0]
    assert report is not None
    report["reference_sensitivity"] = reference_sensitivity(run.reference)
    report["criteria"] = asdict(crit)
    report["run"] = asdict(run)
    report["pass"] = verdict(report, crit)
    return report


def format_report(report: dict[str, Any]) -> str:
    crit = report["criteria"]
    lines = [
        f"teacher-forced blocks (token agrees: every element within {crit['ulps']:g} bf16 ulp; "
        f"pass >= {crit['block_share']:.0%} of tokens)",
        f"  {'block':>5} {'tokens ok':>10} {'max abs':>10} {'rms rel':>10}",
    ]
    for b in report["blocks"]:
        lines.append(
            f"  {b['block']:>5} {b['tf_token_agree']:>10.1%} {b['max_abs']:>10.3g} "
            f"{b['rms_rel']:>10.3g}"
        )
    lines.append(
        f"index top-k vs the reference (sets, up to ties; pass >= {crit['topk_share']:.0%})"
    )
    for t in report["topk"]:
        lines.append(
            f"  layer {t['layer']}: {t['match_share']:.1%} match "
            f"({t['exact_share']:.1%} exact, {t['tie_matches']} by ties)"
        )
    lg = report["logits"]
    lines.append(
        f"full_logits: rms rel {lg['rms_rel']:.4g} (max {crit['logits_rms_rel']:g}), top-1 "
        f"{lg['top1_agree']:.1%} (min {crit['logits_top1']:.0%}), max abs {lg['max_abs']:.3g}"
    )
    sens = report.get("reference_sensitivity")
    if sens:
        lines.append(
            f"  the reference's own sensitivity (prefill {sens.get('prefix')} + one token at a "
            f"time vs one-shot): rms rel {sens.get('rms_rel')}, top-1 {sens.get('top1_agree')}"
        )
    dec = report.get("decode")
    if dec:
        first = "same" if dec["first_token_agree"] else "differs"
        lines.append(
            f"decode (reported, not judged): first token {first}; steps fed the reference's "
            f"tokens vs its decode path: rms rel {dec['rms_rel']:.3g}, "
            f"top-1 {dec['top1_agree']:.0%}"
        )
        one = dec.get("vs_prefill_of_decoded")
        if one:
            lines.append(
                f"  last step vs the reference's one-shot prefill of prompt + decoded tokens: "
                f"rms rel {one['rms_rel']:.3g}, top-1 {one['top1_agree']:.0%}"
            )
    lines.append("PASS" if report["pass"] else "FAIL")
    return "\n".join(lines)
