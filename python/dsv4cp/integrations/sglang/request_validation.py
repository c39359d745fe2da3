"""Request checks the plugin adds on top of SGLang 0.5.23's, for dsv4cp-served models.

`validate_generate_request` runs in the tokenizer manager on each single request (a batch is
split into items first), before anything reaches the scheduler; its ValueError becomes HTTP 400.
Three classes of defect are covered:

- a per-request field of the wrong type or out of range that SGLang forwards unchecked and its
  scheduler then fails on, which kills the scheduler and with it the server: `logprob_start_len`
  below -1 or not an int (a list for a single request), `top_logprobs_num` above the vocabulary
  or negative, token ids outside the vocabulary, a prompt with no tokens, `stop_token_ids`
  outside the vocabulary (with `min_new_tokens` > 0 the min-new-tokens penalizer scatters them
  into a vocabulary-wide row: index out of bounds), `top_k` above int32 (the sampling batch
  holds top-k as int32: overflow); or that fails in the tokenizer manager with a 500 (`rid` a
  list for a single prompt, a per-item list of a batch shorter than the batch — sampling and
  logprob fields, `custom_logit_processor`, the disaggregation `bootstrap_*` fields — or a
  field below that no item may carry, given as a batch list of any length:
  `validate_request_ids`, run after batch normalisation, before SGLang splits the batch and
  files the items under their ids); `n` (samples per prompt) outside [1, 128] (0 failed with
  "range() arg 3 must not be zero", a negative n was served as 1, n = 100000 queued that many
  sequences and stalled the server); `sampling_params` a list for a single prompt, a
  `stop_regex` that does not compile (500s in the tokenizer manager); on the OpenAI
  endpoints, `/v1/detokenize` ids outside the vocabulary (a negative one: 500);
- a field SGLang accepts and then answers wrongly: a `logit_bias` value that is not a number
  within ±1e30 (an infinite bias, e.g. 1e39 in float32, turns a sampled row's probabilities to
  NaN and the sampler returns token 0), a `repetition_penalty` below 1e-6 (0 or subnormal in
  float32: a repeated token's logit becomes inf or NaN, the same token 0), a bool in
  `token_ids_logprob` (read as token 0 or 1: SGLang's HTTP schema refuses bools, its
  tokenizer manager's check, which Python `Engine` callers meet alone, counts them as ints),
  an empty `stop` string or `stop_regex` (matches at once: every answer empty), an OpenAI
  chat `max_completion_tokens` / `max_tokens` of 0 (dropped: the answer ran to the context);
- a field SGLang accepts but a dsv4cp-served model cannot honour, which would be ignored
  silently: `input_embeds` (the model embeds token ids itself), multimodal data, positional
  embedding overrides, LoRA adapters, routed-expert or indexer top-k returns.

Pure: reads attributes of SGLang's `GenerateReqInput` item (or OpenAI request), imports nothing
from sglang.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from dsv4cp.config_fields import is_finite_number, is_int

__all__ = [
    "chat_request_error",
    "detokenize_request_error",
    "validate_generate_request",
    "validate_request_ids",
]


def _is_opt_str(v: object) -> bool:
    return v is None or isinstance(v, str)


# (field, accepted, message): the request is refused when `accepted(value)` is false.
_TYPE_RULES: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("rid", _is_opt_str, "must be a string for a single prompt"),
    ("return_logprob", lambda v: isinstance(v, bool), "must be true or false"),
    ("stream", lambda v: isinstance(v, bool), "must be true or false"),
    (
        "logprob_start_len",
        lambda v: is_int(v) and int(v) >= -1,  # type: ignore[call-overload]
        "must be an integer >= -1 (-1: no input logprobs)",
    ),
    ("session_id", _is_opt_str, "must be a string"),
    ("session_params", lambda v: v is None or isinstance(v, dict), "must be an object"),
    ("extra_key", _is_opt_str, "must be a string"),
    ("cache_salt", _is_opt_str, "must be a string"),
    ("routing_key", _is_opt_str, "must be a string"),
    ("priority", lambda v: v is None or is_int(v), "must be an integer"),
    (
        "routed_dp_rank",
        lambda v: v is None or v == 0,
        "must be 0 or absent: a dsv4cp-served model runs without data parallelism",
    ),
)

# Fields a dsv4cp-served model cannot honour: refused, never ignored.
_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("input_embeds", "dsv4cp embeds token ids itself; send text or input_ids"),
    ("positional_embed_overrides", "dsv4cp embeds token ids itself"),
    ("image_data", "a dsv4cp-served model is text-only"),
    ("video_data", "a dsv4cp-served model is text-only"),
    ("audio_data", "a dsv4cp-served model is text-only"),
    ("lora_path", "dsv4cp serves no LoRA adapters"),
    ("lora_id", "dsv4cp serves no LoRA adapters"),
    ("return_routed_experts", "dsv4cp does not record routed experts"),
    ("return_indexer_topk", "dsv4cp does not return the indexer's top-k"),
    ("multi_item_delimiter_indices", "multi-item scoring is not supported by dsv4cp"),
    ("token_indices_to_pool", "pooling is not supported by dsv4cp"),
)


# Fields a batch holds one entry per item of after SGLang's normalisation, where SGLang keeps a
# list as given without checking its length; a shorter list makes SGLang's item split
# (GenerateReqInput.__getitem__) fail with an IndexError (HTTP 500). (`_UNSUPPORTED` fields
# present in a batch are refused before their lengths matter.)
_PER_ITEM: tuple[str, ...] = (
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
)
_INT32_MAX = 2**31 - 1
# Samples per prompt (`n`), OpenAI's own bound. SGLang has none: one request with n = 100000
# queued 100,000 sequences, and the server answered nothing else for minutes.
MAX_PARALLEL_SAMPLES = 128
# |bias| / temperature stays finite in float32 for every sampled temperature (>= 1e-6; below
# that SGLang samples greedily): 1e30 / 1e-6 = 1e36 < 3.4e38.
_LOGIT_BIAS_LIMIT = 1e30
# SGLang divides a repeated token's positive logit by the repetition penalty (in float32, before
# the bias and the temperature): a penalty in (0, 1e-6) turns into 0 or a subnormal and the logit
# into inf or NaN (sampled token 0, null logprobs). From 1e-6 on, a logit up to 1e20 stays
# finite through penalty, bias and temperature: (1e20 / 1e-6 + 1e30) / 1e-6 ~ 1e36 < 3.4e38.
_REPETITION_PENALTY_MIN = 1e-6
# SGLang 0.5.23 refuses a stop_regex over 256 UTF-8 bytes itself; longer ones are not compiled
# here (a 1 MB pattern takes seconds to compile).
_STOP_REGEX_MAX_BYTES = 256


def _present(v: object) -> bool:
    if v is None or v is False:
        return False
    if isinstance(v, (list, tuple, dict, str)) and not v:
        return False
    if isinstance(v, (list, tuple)) and all(x is None for x in v):
        return False
    return True


def validate_generate_request(
    obj: object, input_ids: Sequence[int] | None, *, vocab_size: int
) -> None:
    """Raise ValueError (HTTP 400) naming the field when one request item is not servable.

    `obj` is one item of SGLang's `GenerateReqInput` after batch normalisation; `input_ids` the
    prompt's tokens (None for `input_embeds` requests)."""
    _refuse_unsupported(obj)
    for name, accepted, message in _TYPE_RULES:
        if hasattr(obj, name) and not accepted(getattr(obj, name)):
            raise ValueError(f"{name} {message}, got {getattr(obj, name)!r}")
    top = getattr(obj, "top_logprobs_num", 0)
    if not is_int(top) or not 0 <= top <= vocab_size:
        raise ValueError(
            f"top_logprobs_num must be an integer in [0, {vocab_size}] (the vocabulary), "
            f"got {top!r}"
        )
    _check_token_ids_logprob(getattr(obj, "token_ids_logprob", None), vocab_size)
    params = getattr(obj, "sampling_params", None)
    if params is not None and not isinstance(params, dict):
        # a list for one prompt: SGLang's own check calls .get on it (HTTP 500)
        raise ValueError(
            f"sampling_params must be an object for a single prompt, got {type(params).__name__}"
        )
    _check_sampling_params(params, vocab_size)
    if input_ids is None:
        return
    if len(input_ids) == 0:  # e.g. text "": an empty extend would reach the model
        raise ValueError("the prompt has no tokens")
    bad = next((t for t in input_ids if not _in_vocab(t, vocab_size)), None)
    if bad is not None:
        raise ValueError(f"input token id {bad!r} is outside the vocabulary [0, {vocab_size})")


def _refuse_unsupported(obj: object) -> None:
    for name, message in _UNSUPPORTED:
        if _present(getattr(obj, name, None)):
            raise ValueError(f"{name} is not supported: {message}")


def _in_vocab(t: object, vocab_size: int) -> bool:
    return is_int(t) and 0 <= t < vocab_size  # type: ignore[operator]


def _check_token_ids_logprob(ids: object, vocab_size: int) -> None:
    """One item's `token_ids_logprob`: None or a flat list of vocabulary ids (not bools)."""
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}")
    bad = [t for t in ids if not _in_vocab(t, vocab_size)]
    if bad:
        raise ValueError(
            f"token_ids_logprob: {bad[0]!r} is not a token id in the vocabulary [0, {vocab_size})"
        )


def _check_sampling_params(params: object, vocab_size: int) -> None:
    """The `sampling_params` dict of one item: what SGLang's SamplingParams.verify misses."""
    if not isinstance(params, dict):
        return
    stop = params.get("stop_token_ids")
    if stop is not None:
        if not isinstance(stop, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop!r}")
        # None entries are dropped by SGLang's SamplingParams
        bad = [t for t in stop if t is not None and not _in_vocab(t, vocab_size)]
        if bad:
            raise ValueError(
                f"stop_token_ids: {bad[0]!r} is not a token id in the vocabulary [0, {vocab_size})"
            )
    _check_stops(params.get("stop"), params.get("stop_regex"))
    penalty = params.get("repetition_penalty")
    if isinstance(penalty, (int, float)) and 0 < penalty < _REPETITION_PENALTY_MIN:
        raise ValueError(
            f"repetition_penalty must be at least {_REPETITION_PENALTY_MIN:g} (1.0: no penalty), "
            f"got {penalty!r}"
        )
    top_k = params.get("top_k")
    if isinstance(top_k, (int, float)) and not isinstance(top_k, bool) and top_k > _INT32_MAX:
        raise ValueError(f"top_k must be at most {_INT32_MAX} (-1: no top-k), got {top_k!r}")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            if not (is_finite_number(value) and abs(value) <= _LOGIT_BIAS_LIMIT):
                raise ValueError(
                    f"logit_bias[{key!r}] must be a number in [-{_LOGIT_BIAS_LIMIT:g}, "
                    f"{_LOGIT_BIAS_LIMIT:g}], got {value!r}"
                )


def _as_list(v: object) -> list:
    return [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else []


def _check_stops(stop: object, stop_regex: object) -> None:
    """Stop strings and patterns: none empty (an empty one matches at once and every answer is
    empty); every pattern compiles (SGLang's normalisation parses them unguarded: an invalid one
    raised re.error or OverflowError, HTTP 500). Types and lengths are SGLang's own check."""
    if any(s == "" for s in _as_list(stop)):
        raise ValueError("stop: an empty string matches at once (every answer would be empty)")
    for pattern in _as_list(stop_regex):
        if not isinstance(pattern, str) or len(pattern.encode()) > _STOP_REGEX_MAX_BYTES:
            continue
        if pattern == "":
            raise ValueError(
                "stop_regex: an empty pattern matches at once (every answer would be empty)"
            )
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError, ValueError) as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid pattern: {e}") from None


def chat_request_error(request: object) -> str | None:
    """An OpenAI chat request's `max_completion_tokens` / `max_tokens` when given: at least 1.
    SGLang reads `max_completion_tokens or max_tokens`: a 0 was dropped, and the answer ran to
    the context length (or to the other field)."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = getattr(request, name, None)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return f"{name} must be at least 1, got {v!r}"
    return None


def detokenize_request_error(tokens: object, vocab_size: int) -> str | None:
    """`/v1/detokenize` tokens (a list of ids, or of lists of ids): ids in the vocabulary. A
    negative id or one above 2**32 - 1 failed in the tokenizer's decode (HTTP 500); one between
    the vocabulary and 2**32 decoded to nothing."""
    nested = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
    rows: list = tokens if nested else [tokens]  # type: ignore[assignment]
    for row in rows:
        if not isinstance(row, list):
            continue  # SGLang refuses other shapes itself
        bad = next((t for t in row if is_int(t) and not _in_vocab(t, vocab_size)), None)
        if bad is not None:
            return f"tokens: {bad!r} is not a token id in the vocabulary [0, {vocab_size})"
    return None


def validate_request_ids(obj: object) -> None:
    """`rid` of a normalised request: a string for a single prompt, strings for a batch; in a
    batch, every per-item list at least as long as the batch; `n` in [1, MAX_PARALLEL_SAMPLES]."""
    n = getattr(obj, "parallel_sample_num", 1)
    if not is_int(n) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
        raise ValueError(
            f"n (samples per prompt) must be an integer in [1, {MAX_PARALLEL_SAMPLES}], got {n!r}"
        )
    rid = getattr(obj, "rid", None)
    if getattr(obj, "is_single", True):
        if not isinstance(rid, str):
            raise ValueError(f"rid must be a string for a single prompt, got {rid!r}")
        return
    if not (isinstance(rid, list) and all(isinstance(r, str) for r in rid)):
        raise ValueError(f"rid must be a list of strings for a batch, got {rid!r}")
    _refuse_unsupported(obj)  # a batch's lora_path or video_data list is never split
    for name in _PER_ITEM:
        value = getattr(obj, name, None)
        if isinstance(value, list) and len(value) < len(rid):
            raise ValueError(
                f"{name} has {len(value)} entries for a batch of {len(rid)} prompts "
                "(one per prompt, or one value for all)"
            )
