"""dsv4cp's request checks (integrations/sglang/request_validation.py), without a server.

The same requests go through a real server in test_server.py; here every rule is exercised on a
stand-in of one normalised `GenerateReqInput` item.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsv4cp.integrations.sglang.request_validation import (
    chat_request_error,
    detokenize_request_error,
    validate_generate_request,
    validate_request_ids,
)

VOCAB = 512


def _item(**fields: object) -> SimpleNamespace:
    """A valid single request item as SGLang normalises it, with `fields` replaced."""
    base = dict(
        rid="r0",
        return_logprob=False,
        stream=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        sampling_params={"max_new_tokens": 4},
        session_id=None,
        session_params=None,
        extra_key=None,
        cache_salt=None,
        routing_key=None,
        priority=None,
        routed_dp_rank=None,
        input_embeds=None,
        positional_embed_overrides=None,
        image_data=None,
        video_data=None,
        audio_data=None,
        lora_path=None,
        lora_id=None,
        return_routed_experts=False,
        return_indexer_topk=False,
        multi_item_delimiter_indices=None,
        token_indices_to_pool=None,
        is_single=True,
    )
    base.update(fields)
    return SimpleNamespace(**base)


def test_valid_requests_pass() -> None:
    validate_generate_request(_item(), [1, 2, 3], vocab_size=VOCAB)
    validate_generate_request(
        _item(
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=VOCAB,
            priority=3,
            routed_dp_rank=0,
            image_data=[None],
            session_params={"id": "s"},
            token_ids_logprob=[0, VOCAB - 1],
            sampling_params={
                "stop_token_ids": [0, VOCAB - 1, None],
                "min_new_tokens": 2,
                "top_k": 2**31 - 1,
                "logit_bias": {"9": 1e30, "3": -1e30, "4": 0},
            },
        ),
        [0, VOCAB - 1],
        vocab_size=VOCAB,
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        # the two requests that killed SGLang 0.5.23's scheduler (reliability probe D1)
        ({"return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
        ({"return_logprob": True, "top_logprobs_num": 1_000_000}, "top_logprobs_num"),
        # the same fields with the wrong type for a single prompt (a list kills the scheduler)
        ({"return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len"),
        ({"logprob_start_len": True}, "logprob_start_len"),
        ({"top_logprobs_num": [2]}, "top_logprobs_num"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": VOCAB + 1}, "top_logprobs_num"),
        ({"return_logprob": [True]}, "return_logprob"),
        ({"stream": "yes"}, "stream"),
        ({"rid": ["a", "b"]}, "rid"),
        ({"priority": 1.5}, "priority"),
        ({"routed_dp_rank": 2}, "routed_dp_rank"),
        ({"session_params": "x"}, "session_params"),
        ({"extra_key": 5}, "extra_key"),
        # fields a dsv4cp-served model cannot honour: refused, never ignored
        ({"input_embeds": [[0.5] * 8]}, "input_embeds"),
        ({"positional_embed_overrides": {"a": 1}}, "positional_embed_overrides"),
        ({"image_data": "http://x/y.png"}, "image_data"),
        ({"video_data": ["v.mp4"]}, "video_data"),
        ({"audio_data": "a.wav"}, "audio_data"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"return_routed_experts": True}, "return_routed_experts"),
        ({"return_indexer_topk": True}, "return_indexer_topk"),
        ({"multi_item_delimiter_indices": [1]}, "multi_item_delimiter_indices"),
        ({"token_indices_to_pool": [0]}, "token_indices_to_pool"),
    ],
)
def test_bad_field_is_refused_by_name(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_generate_request(_item(**fields), [1, 2], vocab_size=VOCAB)


@pytest.mark.parametrize("ids", [[], [1, VOCAB], [-1, 5], [2**40], [1.5], ["5"], [True]])
def test_prompt_tokens_must_be_vocabulary_ids(ids: list) -> None:
    with pytest.raises(ValueError, match="prompt has no tokens|outside the vocabulary"):
        validate_generate_request(_item(), ids, vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        # SGLang's HTTP schema refuses a bool here, its tokenizer manager counts it as an int
        ({"token_ids_logprob": [True]}, "token_ids_logprob"),
        ({"token_ids_logprob": [VOCAB]}, "token_ids_logprob"),
        ({"token_ids_logprob": [-1]}, "token_ids_logprob"),
        ({"token_ids_logprob": [[1]]}, "token_ids_logprob"),
        ({"token_ids_logprob": [1.0]}, "token_ids_logprob"),
        ({"token_ids_logprob": 5}, "token_ids_logprob"),
        # killed the scheduler with min_new_tokens > 0 (the min-new-tokens penalizer's scatter)
        ({"stop_token_ids": [VOCAB + 88], "min_new_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        # killed the scheduler (top-k held as int32)
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 3e9}, "top_k"),
        # an infinite bias (1e39 in float32) sampled token 0 with NaN logprobs
        ({"logit_bias": {"9": 1e39}}, "logit_bias"),
        ({"logit_bias": {"9": float("inf")}}, "logit_bias"),
        ({"logit_bias": {"9": float("-inf")}}, "logit_bias"),
        ({"logit_bias": {"9": float("nan")}}, "logit_bias"),
        ({"logit_bias": {"9": -1e31}}, "logit_bias"),
        ({"logit_bias": {"9": "1"}}, "logit_bias"),
        ({"logit_bias": {"9": True}}, "logit_bias"),
        # 0 or subnormal in float32: a repeated token's logit became inf / NaN (token 0)
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"repetition_penalty": 9e-7}, "repetition_penalty"),
        # an empty stop string / pattern matched at once: every answer was empty
        ({"stop": ""}, "stop: an empty string"),
        ({"stop": ["a", ""]}, "stop: an empty string"),
        ({"stop_regex": ""}, "stop_regex: an empty pattern"),
        # SGLang's normalisation raised re.error / OverflowError: HTTP 500
        ({"stop_regex": "[a-"}, "stop_regex '\\[a-' is not a valid pattern"),
        ({"stop_regex": ["a", "(("]}, "stop_regex"),
        ({"stop_regex": "a{4294967296}"}, "stop_regex"),
        ({"stop_regex": "(?P<x"}, "stop_regex"),
    ],
)
def test_bad_logprob_or_sampling_field_is_refused(fields: dict, match: str) -> None:
    tids = {k: v for k, v in fields.items() if k == "token_ids_logprob"}
    params = {k: v for k, v in fields.items() if k != "token_ids_logprob"}
    item = _item(sampling_params={"max_new_tokens": 4, **params}, **tids)
    with pytest.raises(ValueError, match=match):
        validate_generate_request(item, [1, 2], vocab_size=VOCAB)


def test_sampling_edge_values_within_bounds_pass() -> None:
    params = {
        "repetition_penalty": 1e-6,
        "stop": ["a", "b"],
        "stop_regex": ["(a)\\1", "(?<=a)b", "x{1,3}", "a" * 300],  # > 256 bytes: SGLang's
    }
    validate_generate_request(_item(sampling_params=params), [1], vocab_size=VOCAB)
    for penalty in (2.0, 1.0, 0.5, None):  # 0 and negatives: SGLang's own (0, 2] check
        item = _item(sampling_params={"repetition_penalty": penalty, "stop": "x"})
        validate_generate_request(item, [1], vocab_size=VOCAB)


@pytest.mark.parametrize("params", [[{"max_new_tokens": 3}], [], ({},), "x"])
def test_sampling_params_must_be_an_object_for_one_prompt(params: object) -> None:
    """A list for one prompt passed SGLang's schema, then its check called .get on it: 500."""
    with pytest.raises(ValueError, match="sampling_params must be an object for a single prompt"):
        validate_generate_request(_item(sampling_params=params), [1], vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({}, None),
        ({"max_completion_tokens": 1}, None),
        ({"max_tokens": 5, "max_completion_tokens": None}, None),
        # `max_completion_tokens or max_tokens`: a 0 was dropped, the answer ran to the context
        ({"max_completion_tokens": 0}, "max_completion_tokens must be at least 1, got 0"),
        ({"max_completion_tokens": 0, "max_tokens": 3}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_completion_tokens": 4, "max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": True}, "max_completion_tokens"),
    ],
)
def test_chat_output_budget(fields: dict, error: str | None) -> None:
    request = SimpleNamespace(**{"max_completion_tokens": None, "max_tokens": None, **fields})
    got = chat_request_error(request)
    assert (got is None) if error is None else (got is not None and error in got), got


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [
        ([5, 6], None),
        ([[5], [VOCAB - 1]], None),
        ([], None),
        ("abc", None),  # SGLang's own type check
        ([-1], -1),
        ([2**40], 2**40),
        ([5, VOCAB], VOCAB),  # decoded to nothing
        ([[5], [6, -3]], -3),
    ],
)
def test_detokenize_ids_in_vocabulary(tokens: object, bad: int | None) -> None:
    """A negative id or one past 2**32 - 1 failed in the tokenizer's decode: HTTP 500."""
    got = detokenize_request_error(tokens, VOCAB)
    if bad is None:
        assert got is None
    else:
        assert got == f"tokens: {bad} is not a token id in the vocabulary [0, {VOCAB})"


def test_input_embeds_without_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="input_embeds"):
        validate_generate_request(_item(input_embeds=[[0.1, 0.2]]), None, vocab_size=VOCAB)


def test_request_ids_match_the_request_shape() -> None:
    validate_request_ids(_item(rid="x"))
    validate_request_ids(_item(rid=["a", "b"], is_single=False))
    for obj in (_item(rid=["a"]), _item(rid=5), _item(rid=None)):
        with pytest.raises(ValueError, match="rid must be a string"):
            validate_request_ids(obj)
    with pytest.raises(ValueError, match="list of strings"):
        validate_request_ids(_item(rid=["a", 3], is_single=False))


BATCH_LISTS = dict(
    sampling_params=[{}, {}],
    return_logprob=[True, True],
    logprob_start_len=[-1, -1],
    top_logprobs_num=[0, 0],
    token_ids_logprob=[[1], [2]],
    return_sampling_mask=[False, True],
    sampling_logprobs_mode=[None, None],
    custom_logit_processor=[None, "p"],
    bootstrap_host=["h", "h"],
    bootstrap_port=[1, 2],
    bootstrap_room=[3, 4],
    bootstrap_pair_key=[None, None],
    decode_tp_size=[None, 1],
)


@pytest.mark.parametrize("name", [n for n in BATCH_LISTS if n != "token_ids_logprob"])
def test_batch_per_item_lists_cover_the_batch(name: str) -> None:
    """A per-item list shorter than the batch: SGLang's item split raised IndexError (500)."""
    full = dict(rid=["a", "b"], is_single=False, **BATCH_LISTS)
    validate_request_ids(_item(**full))
    validate_request_ids(_item(**{**full, name: full[name] + full[name]}))  # longer: SGLang's
    with pytest.raises(ValueError, match=f"{name} has 1 entries for a batch of 2"):
        validate_request_ids(_item(**{**full, name: full[name][:1]}))


def test_batch_token_ids_logprob_covers_the_batch() -> None:
    item = _item(rid=["a", "b"], is_single=False, token_ids_logprob=[[1]])
    with pytest.raises(ValueError, match="token_ids_logprob has 1 entries for a batch of 2"):
        validate_request_ids(item)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("lora_path", ["adapter"]),
        ("lora_id", "x"),
        ("video_data", ["v.mp4"]),
        ("audio_data", [None, "a.wav"]),
        ("multi_item_delimiter_indices", [[1]]),
        ("token_indices_to_pool", [[0]]),
    ],
)
def test_batch_with_an_unsupported_field_is_refused_before_the_split(
    name: str, value: object
) -> None:
    """Refused for the batch, whatever the list's length (a short one was SGLang's 500)."""
    with pytest.raises(ValueError, match=f"{name} is not supported"):
        validate_request_ids(_item(rid=["a", "b"], is_single=False, **{name: value}))
    # the normalised absence of these fields ([None] * n) passes
    validate_request_ids(_item(rid=["a", "b"], is_single=False, **{name: [None, None]}))


@pytest.mark.parametrize("n", [0, -2, 129, 100_000, 1.5, "3", True])
def test_samples_per_prompt_out_of_range_are_refused(n: object) -> None:
    """SGLang has no bound: n = 100000 queued that many sequences and stalled the server."""
    for obj in (
        _item(parallel_sample_num=n),
        _item(rid=["a"], is_single=False, parallel_sample_num=n),
    ):
        with pytest.raises(
            ValueError, match=r"n \(samples per prompt\) must be an integer in \[1, 128\]"
        ):
            validate_request_ids(obj)


def test_samples_per_prompt_in_range_pass() -> None:
    validate_request_ids(_item(parallel_sample_num=1))
    validate_request_ids(_item(rid=["a", "b"], is_single=False, parallel_sample_num=128))
