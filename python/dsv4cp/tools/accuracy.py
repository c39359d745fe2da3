"""`dsv4cp accuracy`: a running server's greedy output against dsv4cp's own runner.

A fixed prompt set (several lengths, two prompts sharing a long prefix, one longer than a typical
small chunked-prefill size) goes to the server's `/generate` with greedy sampling, input and
output logprobs. The reference replays each prompt through `PrefillRunner` on the same checkpoint,
teacher-forced with the server's tokens, so one near-tie flip does not cascade. A prompt passes
when every greedy token matches (or the two candidates are within `atol` in the reference: a tie)
and every compared logprob (chosen token, top-k, prompt tokens) is within `atol`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

BASE_SENTENCE = (
    "the quick brown fox jumps over the lazy dog while a distant bell rings twice at dawn and "
)

PROMPTS: tuple[str, ...] = (
    "Hello",
    "DeepSeek attention under context parallelism.",
    BASE_SENTENCE * 2 + "then what?",
    BASE_SENTENCE * 2 + "and nobody listens to it anymore.",  # shares a prefix with the one above
    "Numbers: " + " ".join(str(i) for i in range(60)),
    BASE_SENTENCE * 6 + "the end.",
)


@dataclass
class PromptResult:
    index: int
    prompt_len: int
    steps: int
    matched: int
    ties: int
    first_mismatch: int | None
    max_output_diff: float
    max_top_diff: float
    max_input_diff: float
    error: str | None = None

    def passed(self, atol: float) -> bool:
        if self.error is not None:
            return False
        return (
            self.matched + self.ties == self.steps
            and max(self.max_output_diff, self.max_top_diff, self.max_input_diff) <= atol
        )


@dataclass
class Report:
    atol: float
    results: list[PromptResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed(self.atol) for r in self.results)

    def table(self) -> str:
        head = (
            f"{'#':>2} {'len':>5} {'tokens':>9} {'ties':>4} {'1st diff':>8} "
            f"{'|dlp| out':>10} {'|dlp| top':>10} {'|dlp| in':>10}  result"
        )
        lines = [head, "-" * len(head)]
        for r in self.results:
            if r.error is not None:
                lines.append(
                    f"{r.index:>2} {r.prompt_len:>5} {'-':>9} {'-':>4} {'-':>8} "
                    f"{'-':>10} {'-':>10} {'-':>10}  FAIL ({r.error})"
                )
                continue
            first = "-" if r.first_mismatch is None else str(r.first_mismatch)
            lines.append(
                f"{r.index:>2} {r.prompt_len:>5} {r.matched:>4}/{r.steps:<4} {r.ties:>4} "
                f"{first:>8} {r.max_output_diff:>10.2e} {r.max_top_diff:>10.2e} "
                f"{r.max_input_diff:>10.2e}  {'PASS' if r.passed(self.atol) else 'FAIL'}"
            )
        verdict = "PASS" if self.passed else "FAIL"
        n_ok = sum(r.passed(self.atol) for r in self.results)
        lines.append(f"{verdict}: {n_ok}/{len(self.results)} prompts within atol={self.atol:g}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "atol": self.atol,
            "passed": self.passed,
            "prompts": [dict(vars(r), passed=r.passed(self.atol)) for r in self.results],
        }


# ---------------------------------------------------------------------------------- server
def post_generate(base_url: str, payload: dict, timeout_s: float = 300.0) -> dict:
    req = urllib.request.Request(
        base_url.rstrip("/") + "/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except http.client.HTTPException as e:  # a reply that is not HTTP, a body cut short
        detail = " ".join(str(e).split())  # BadStatusLine quotes the line, newline included
        raise ConnectionError(f"not a valid HTTP answer ({type(e).__name__}: {detail})") from None
    return json.loads(body)


def check_server(base_url: str, timeout_s: float = 30.0) -> None:
    """ConnectionError unless a server answers at `base_url`: nothing listening, or SGLang still
    starting (`/health` 503), is one message before any prompt is sent or the runner is built.
    Any other answer (a server without `/health` included) is left to the prompts to judge."""
    url = base_url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:
        if e.code == 503:
            raise ConnectionError(
                f"the server at {base_url} is not ready yet (/health: HTTP 503); wait for it"
            ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        why = getattr(e, "reason", e)
        raise ConnectionError(
            f"no server answers at {base_url} ({why}); start it first (docs/sglang.md)"
        ) from None


def greedy_payload(input_ids: list[int], max_new_tokens: int, top_k: int) -> dict:
    return {
        "input_ids": input_ids,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top_k,
    }


# ---------------------------------------------------------------------------------- reference
def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_path}")
    return Tokenizer.from_file(str(path))


class Reference:
    """dsv4cp's runner on the checkpoint; one fresh request per prompt, teacher-forced.

    A released-format checkpoint loads with `from_checkpoint`, an export with `from_pretrained`;
    `quant` "auto" is `model.default_quant` for either (qat when config.json has a
    quantization_config, as the server's default). `dtype`
    "auto": bfloat16 for a released checkpoint, float32 for an export (the server's `--dtype`)."""

    def __init__(
        self, model_path: str | os.PathLike[str], dtype: str = "auto", quant: str = "auto"
    ) -> None:
        import torch

        from dsv4cp.config import DeepseekV41Config, checkpoint_kind
        from dsv4cp.model import DeepseekV41Model, default_quant

        self.torch = torch
        released = checkpoint_kind(model_path) == "released"
        if dtype == "auto":
            dtype = "bfloat16" if released else "float32"
        if quant == "auto":
            quant = default_quant(DeepseekV41Config.from_hf(model_path))
        self.dtype, self.quant = dtype, quant
        if released:
            self.model = DeepseekV41Model.from_checkpoint(
                model_path, quant=quant, dtype=getattr(torch, dtype), device="cpu"
            )
        else:  # its own numerics (default_quant), then the one asked for (checked there)
            self.model = DeepseekV41Model.from_pretrained(
                model_path, dtype=getattr(torch, dtype), device="cpu"
            )
            self.model.set_quant(quant)
        self.context = int(self.model.config.max_position_embeddings)

    def logprobs(self, prompt: list[int], forced: list[int]) -> tuple[Tensor, Tensor]:
        """(input log-probs [len-1] of prompt[1:], output log-softmax rows [len(forced), V])."""
        from dsv4cp.runner import PrefillRunner

        torch = self.torch
        n = len(prompt) + len(forced)
        runner = PrefillRunner(
            self.model, num_slots=n + 64, max_requests=2, max_context=n + 16, page_size=16
        )
        all_logits = runner.prefill([("r", prompt)], return_all_logits=True).all_logits
        if all_logits is None:
            raise ValueError("accuracy: the runner returned no all_logits")
        all_lp = torch.log_softmax(all_logits.float(), -1)
        idx = torch.tensor(prompt[1:], dtype=torch.long)
        input_lp = all_lp[:-1].gather(1, idx[:, None])[:, 0]
        rows = [all_lp[-1]]
        for tok in forced[:-1]:
            rows.append(torch.log_softmax(runner.decode({"r": tok}).logits[0].float(), -1))
        return input_lp, torch.stack(rows)


ANSWER_LISTS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "input_token_logprobs",
    "input_top_logprobs",
)


def _entry_problem(entry: Any, vocab: int | None, *, first_input: bool = False) -> str | None:
    """Why one `[logprob, token id, ...]` entry of an answer is unusable, or None: the logprob
    must be a finite number (None only for the first prompt token), the id an int in the
    vocabulary."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        return f"entry {entry!r} is not [logprob, token id, ...]"
    lp, tid = entry[0], entry[1]
    if not (first_input and lp is None):
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            return f"logprob {lp!r} is not a finite number"
    if isinstance(tid, bool) or not isinstance(tid, int):
        return f"token id {tid!r} is not an integer"
    if vocab is not None and not 0 <= tid < vocab:
        return f"token id {tid} is outside the vocabulary [0, {vocab})"
    return None


def _malformed(meta: Any, vocab: int | None) -> str | None:
    """Why the lists of an answer's meta_info are not the shape `incomplete_answer` counts, or
    hold an unusable entry (a NaN or inf logprob, a token id outside the vocabulary), or None."""
    if not isinstance(meta, dict):
        return f"meta_info is {type(meta).__name__}, not an object"
    for key in ANSWER_LISTS:
        value = meta.get(key) or []
        if not isinstance(value, list):
            return f"{key} is {type(value).__name__}, not a list"
        for i, item in enumerate(value):
            top = key.endswith("top_logprobs")
            entries = (item or []) if top else [item]
            if not isinstance(entries, list):
                return f"{key}[{i}] is {type(entries).__name__}, not a list"
            for e in entries:
                why = _entry_problem(e, vocab, first_input=key == "input_token_logprobs" and i == 0)
                if why is not None:
                    return f"{key}[{i}]: {why}"
    return None


def incomplete_answer(
    meta: Any, *, prompt_len: int, new_tokens: int, top_k: int, vocab: int | None = None
) -> str | None:
    """Why a `greedy_payload` answer lacks something that was asked for or holds something
    unusable (a malformed list, a non-finite logprob, a token id outside [0, `vocab`)), or None.

    The payload sets `ignore_eos`, `logprob_start_len` 0 and `top_logprobs_num`, so a complete
    answer has `new_tokens` output tokens and logprobs, `top_k` candidates per step, and
    logprobs (and top-k, after the first) for every prompt token."""
    bad = _malformed(meta, vocab)
    if bad is not None:
        return f"malformed server answer: {bad}"
    out = meta.get("output_token_logprobs") or []
    if len(out) != new_tokens:
        return f"server returned {len(out)} tokens, asked for {new_tokens}"
    tops = meta.get("output_top_logprobs") or []
    if len(tops) != new_tokens or any(len(t or []) != top_k for t in tops):
        return f"server returned fewer than {top_k} top logprobs for some of {new_tokens} steps"
    inputs = meta.get("input_token_logprobs") or []
    if len(inputs) != prompt_len or any(t[0] is None for t in inputs[1:]):
        return f"server returned {len(inputs)} prompt logprobs, asked for {prompt_len}"
    in_tops = meta.get("input_top_logprobs") or []
    if len(in_tops) != prompt_len or any(len(t or []) != top_k for t in in_tops[1:]):
        return f"server returned fewer than {top_k} top logprobs for some prompt tokens"
    return None


def compare_one(
    index: int,
    prompt: list[int],
    server: dict,
    ref: Reference,
    atol: float,
    top_k: int,
    new_tokens: int,
) -> PromptResult:
    meta = server["meta_info"]
    missing = incomplete_answer(
        meta,
        prompt_len=len(prompt),
        new_tokens=new_tokens,
        top_k=top_k,
        vocab=int(ref.model.config.vocab_size),
    )
    if missing is not None:
        return PromptResult(index, len(prompt), 0, 0, 0, None, 0.0, 0.0, 0.0, error=missing)
    out_lp = meta["output_token_logprobs"]
    tokens = [int(t[1]) for t in out_lp]
    input_lp, rows = ref.logprobs(prompt, tokens)
    matched = ties = 0
    first = None
    max_out = max_top = 0.0
    for step, (tok, row) in enumerate(zip(tokens, rows)):
        best = int(row.argmax())
        if best == tok:
            matched += 1
        elif float(row[best] - row[tok]) <= atol:
            ties += 1
        elif first is None:
            first = step
        max_out = max(max_out, abs(float(out_lp[step][0]) - float(row[tok])))
        tops = (meta.get("output_top_logprobs") or [None] * len(tokens))[step] or []
        for lp, tid, *_ in tops[:top_k]:
            max_top = max(max_top, abs(float(lp) - float(row[int(tid)])))
    max_in = 0.0
    served_in = meta.get("input_token_logprobs") or []
    served_ids = [int(t[1]) for t in served_in]
    if served_ids and served_ids != prompt:
        return PromptResult(
            index,
            len(prompt),
            len(tokens),
            matched,
            ties,
            first,
            max_out,
            max_top,
            math.inf,
            error="server saw different prompt ids",
        )
    for j, t in enumerate(served_in[1:]):
        if t[0] is not None:
            max_in = max(max_in, abs(float(t[0]) - float(input_lp[j])))
    return PromptResult(
        index, len(prompt), len(tokens), matched, ties, first, max_out, max_top, max_in
    )


def run_accuracy(
    base_url: str,
    model_path: str | os.PathLike[str],
    *,
    max_new_tokens: int = 16,
    top_k: int = 5,
    atol: float = 1e-3,
    concurrency: int = 4,
    dtype: str = "auto",
    quant: str = "auto",
    prompts: tuple[str, ...] = PROMPTS,
    timeout_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """The server's greedy answers to `prompts` against dsv4cp's runner on the same checkpoint;
    `progress` gets a line per stage and per prompt (the runner's teacher-forced pass on CPU
    takes minutes)."""
    say = progress or (lambda _: None)
    if not (math.isfinite(atol) and atol >= 0):
        raise ValueError(f"atol must be a finite number >= 0, got {atol}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
    tok = load_tokenizer(model_path)
    check_server(base_url, min(timeout_s, 30.0))
    say(f"accuracy: building dsv4cp's runner on {model_path}")
    ref = Reference(model_path, dtype, quant)
    # Prompts longer than the model's context (a tiny checkpoint's) keep their first tokens.
    keep = max(1, ref.context - max_new_tokens)
    ids = [tok.encode(p, add_special_tokens=False).ids[:keep] for p in prompts]

    def ask(p: list[int]) -> dict | str:
        try:
            return post_generate(base_url, greedy_payload(p, max_new_tokens, top_k), timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    say(f"accuracy: sending {len(ids)} prompts ({concurrency} at a time) to {base_url}")
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        answers = list(pool.map(ask, ids))
    report = Report(atol)
    for i, (p, ans) in enumerate(zip(ids, answers)):
        say(f"accuracy: prompt {i + 1}/{len(ids)} ({len(p)} tokens): teacher-forced comparison")
        if isinstance(ans, str):
            report.results.append(PromptResult(i, len(p), 0, 0, 0, None, 0.0, 0.0, 0.0, ans))
            continue
        try:
            report.results.append(compare_one(i, p, ans, ref, atol, top_k, max_new_tokens))
        except (KeyError, IndexError, TypeError) as e:
            report.results.append(
                PromptResult(
                    i, len(p), 0, 0, 0, None, 0.0, 0.0, 0.0, f"malformed server answer: {e!r}"
                )
            )
    return report
