"""`dsv4cp accuracy --reference FILE`: a live server against DeepSeek's reference outputs.

FILE is a safetensors file with the keys of tests/fixtures/dsv41-tiny-reference/README.md:
`input_ids` [1, P], `full_logits` [1, P, V] (one-shot prefill), `decoded_ids` [1, N] (greedy next
token, then N-1 greedy decode steps) and `decode_logits` [N-1, V] (the logits of those steps).

One request: the prompt, greedy, N new tokens, logprobs of every prompt position with the top-k.
The server must prefill the prompt in one shot from an empty cache (chunked prefill at least P
tokens, no cached prefix: the reference moves by 25-42 % rms when a prompt is prefilled in
pieces, README); an answer with `cached_tokens` > 0 fails. Checks, statistical because the
reference is defined only up to fp8/fp4 code flips and top-k ties (README):

- prefill top-1: at each prompt position the server's most likely token is the reference's, or
  within `tie` (nats) of it, for at least `min_top1` of the P positions;
- prefill logprobs: rms over positions and the server's top-k tokens of (server − reference)
  log-probability <= `max_rms`; the same for the prompt tokens' own log-probabilities;
- greedy tokens: the N tokens equal `decoded_ids` (a step whose reference top two are within
  `tie` may differ; the steps after it are then not compared);
- decode top-k rms against `decode_logits`: reported, judged (<= `max_rms`) only with
  `judge_decode`: the README calls those logits the reference's decode path, "to report, not to
  match" (on the fixture one of its three steps is 0.47 nats from dsv4cp's, the others 0.02-0.06).

Defaults: turning the reference's quantization off moves its logits by ~16 % rms (0.16 of a 1.0
logit std) and flips the top-1 token at 20-26 % of positions (README); `min_top1` 0.9 and
`max_rms` 0.05 nats fail such a model by a wide margin. Measured against dsv4cp's SGLang server
on the tiny fixture (bf16, qat): docs/sglang.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4cp.tools.accuracy import (
    check_server,
    greedy_payload,
    incomplete_answer,
    post_generate,
)
from dsv4cp.tools.reference_file import read_reference_tensors

REQUIRED_KEYS = ("input_ids", "full_logits", "decoded_ids", "decode_logits")


@dataclass(frozen=True)
class ReferenceTolerance:
    min_top1: float = 0.9
    max_rms: float = 0.05
    tie: float = 0.05
    # The fixture's decode logits are the reference's decode path, "to report, not to match"
    # (README): judged only when asked.
    judge_decode: bool = False

    def __post_init__(self) -> None:
        for name in ("min_top1", "max_rms", "tie"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.min_top1 > 1:
            raise ValueError(f"min_top1 is a fraction in [0, 1], got {self.min_top1}")


@dataclass(frozen=True)
class ReferenceOutputs:
    prompt: list[int]
    prefill_lp: Tensor  # [P, V] log-softmax of full_logits
    decoded: list[int]  # N
    decode_lp: Tensor  # [N-1, V]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ReferenceOutputs:
        t = read_reference_tensors(path, REQUIRED_KEYS)
        for key in REQUIRED_KEYS:  # ids integer, logits floating and finite
            v, ids_key = t[key], key.endswith("_ids")
            if v.dtype == torch.bool or v.is_floating_point() == ids_key:
                kind = "integer" if ids_key else "floating"
                raise ValueError(f"{path}: {key} must be {kind}, got {v.dtype}")
            if not ids_key and not bool(torch.isfinite(v).all()):
                raise ValueError(f"{path}: {key} holds NaN or inf")
        ids, full, dec, dlog = (t[k] for k in REQUIRED_KEYS)
        p, n = ids.shape[-1], dec.shape[-1]
        if (
            ids.dim() != 2
            or ids.shape[0] != 1
            or p < 1
            or full.dim() != 3
            or full.shape[:2] != (1, p)
        ):
            raise ValueError(
                f"{path}: input_ids {tuple(ids.shape)} and full_logits "
                f"{tuple(full.shape)} must be [1, P] and [1, P, V]"
            )
        if dec.dim() != 2 or n < 1 or tuple(dlog.shape) != (n - 1, full.shape[-1]):
            raise ValueError(
                f"{path}: decoded_ids {tuple(dec.shape)} and decode_logits "
                f"{tuple(dlog.shape)} must be [1, N] and [N-1, V]"
            )
        return cls(
            ids[0].tolist(),
            torch.log_softmax(full[0].float(), -1),
            dec[0].tolist(),
            torch.log_softmax(dlog.float(), -1),
        )


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    limit: str
    passed: bool
    judged: bool = True  # False: reported beside the verdict, not part of it


@dataclass
class ReferenceReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        judged = [c for c in self.checks if c.judged]
        return bool(judged) and all(c.passed for c in judged)

    def table(self) -> str:
        head = f"{'reference check':<34} {'value':>22} {'limit':>10}  result"
        lines = [head, "-" * len(head)]
        lines += [
            f"{c.name:<34} {c.value:>22} {c.limit:>10}  "
            + (("PASS" if c.passed else "FAIL") if c.judged else "not judged (information)")
            for c in self.checks
        ]
        judged = [c for c in self.checks if c.judged]
        n_ok = sum(c.passed for c in judged)
        lines.append(f"{'PASS' if self.passed else 'FAIL'}: {n_ok}/{len(judged)} reference checks")
        if any(c.name == "greedy tokens" and "tie" in c.value for c in self.checks):
            lines.append(
                "(greedy tokens: the reference is defined only up to ties; after a step where the "
                "server's token is within the tie margin the texts diverge and are not compared)"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"passed": self.passed, "checks": [vars(c) for c in self.checks]}


def _rms(diffs: list[float]) -> float:
    return math.sqrt(sum(d * d for d in diffs) / len(diffs)) if diffs else 0.0


def _agrees(lp: Tensor, token: int, tie: float) -> bool:
    return float(lp.max() - lp[token]) <= tie


def _reference_tie(lp: Tensor, tie: float) -> bool:
    """The reference's best two tokens are within `tie`: its greedy choice is a coin flip."""
    top = lp.topk(2).values
    return float(top[0] - top[1]) <= tie


def compare_reference(
    answer: dict, ref: ReferenceOutputs, *, top_k: int, tol: ReferenceTolerance
) -> ReferenceReport:
    """Checks of one server answer to `reference_payload(ref, top_k)`."""
    report = ReferenceReport()
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    p, n = len(ref.prompt), len(ref.decoded)
    missing = (
        "answer has no meta_info"
        if not isinstance(meta, dict)
        else incomplete_answer(
            meta, prompt_len=p, new_tokens=n, top_k=top_k, vocab=int(ref.prefill_lp.shape[-1])
        )
    )
    if missing is not None:
        report.checks.append(Check("complete answer", missing[:60], "-", False))
        return report
    assert isinstance(meta, dict)  # incomplete_answer returned None
    cached = int(meta.get("cached_tokens") or 0)
    report.checks.append(Check("one-shot prefill (cached tokens)", str(cached), "0", cached == 0))
    served_prompt = [int(t[1]) for t in meta["input_token_logprobs"]]
    report.checks.append(
        Check(
            "prompt ids echoed",
            "equal" if served_prompt == ref.prompt else "different",
            "equal",
            served_prompt == ref.prompt,
        )
    )
    # Server top-k of prompt position j predicts token j+1: input_top_logprobs[j+1], and the
    # last position's is the first output step's.
    tops = meta["input_top_logprobs"][1:] + [meta["output_top_logprobs"][0]]
    agree = sum(_agrees(ref.prefill_lp[j], int(top[0][1]), tol.tie) for j, top in enumerate(tops))
    report.checks.append(
        Check(
            "prefill top-1 agreement",
            f"{agree}/{p}",
            f">= {tol.min_top1:g}",
            agree >= tol.min_top1 * p,
        )
    )
    top_rms = _rms(
        [
            float(lp) - float(ref.prefill_lp[j, int(tid)])
            for j, top in enumerate(tops)
            for lp, tid, *_ in top
        ]
    )
    report.checks.append(
        Check(
            "prefill top-k logprob rms",
            f"{top_rms:.3e}",
            f"<= {tol.max_rms:g}",
            top_rms <= tol.max_rms,
        )
    )
    in_rms = _rms(
        [
            float(t[0]) - float(ref.prefill_lp[j, ref.prompt[j + 1]])
            for j, t in enumerate(meta["input_token_logprobs"][1:])
        ]
    )
    report.checks.append(
        Check(
            "prompt-token logprob rms",
            f"{in_rms:.3e}",
            f"<= {tol.max_rms:g}",
            in_rms <= tol.max_rms,
        )
    )
    _compare_greedy(report, meta, ref, tol)
    return report


def _compare_greedy(
    report: ReferenceReport, meta: dict, ref: ReferenceOutputs, tol: ReferenceTolerance
) -> None:
    tokens = [int(t[1]) for t in meta["output_token_logprobs"]]
    dists = [ref.prefill_lp[-1], *ref.decode_lp]  # the distribution of each greedy step
    matched, ok, note = 0, True, ""
    diffs: list[float] = []
    for s, (tok, want, lp) in enumerate(zip(tokens, ref.decoded, dists)):
        if s:  # decode steps: the server's top-k against the reference decode logits
            diffs += [float(v) - float(lp[int(t)]) for v, t, *_ in meta["output_top_logprobs"][s]]
        if tok != want:
            # A tie may flip: the server's token within `tie` of the reference's best, or a step
            # where the reference's own top two are within `tie` (the reference is defined only
            # up to such ties, README). The steps after it continue another text: not compared.
            ok = _agrees(lp, tok, tol.tie) or _reference_tie(lp, tol.tie)
            note = f" (step {s}: {'tie' if ok else 'differs'})"
            break
        matched += 1
    limit = "equal, or a tie then unchecked" if note else "equal"
    report.checks.append(Check("greedy tokens", f"{matched}/{len(ref.decoded)}{note}", limit, ok))
    rms = _rms(diffs)
    report.checks.append(
        Check(
            "decode top-k logprob rms",
            f"{rms:.3e}",
            f"<= {tol.max_rms:g}",
            rms <= tol.max_rms,
            judged=tol.judge_decode,
        )
    )


def reference_payload(ref: ReferenceOutputs, top_k: int) -> dict:
    return greedy_payload(ref.prompt, len(ref.decoded), top_k)


def run_reference(
    base_url: str,
    path: str | os.PathLike[str],
    *,
    top_k: int = 5,
    tol: ReferenceTolerance | None = None,
    timeout_s: float = 300.0,
) -> ReferenceReport:
    ref = ReferenceOutputs.load(path)
    check_server(base_url, min(timeout_s, 30.0))
    top_k = min(top_k, int(ref.prefill_lp.shape[-1]))
    try:
        answer = post_generate(base_url, reference_payload(ref, top_k), timeout_s)
    except (OSError, ValueError) as e:
        return ReferenceReport(
            [Check("server answer", f"{type(e).__name__}: {e}"[:60], "-", False)]
        )
    return compare_reference(answer, ref, top_k=top_k, tol=tol or ReferenceTolerance())
