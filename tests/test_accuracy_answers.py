"""`dsv4cp accuracy` against servers that answer badly: a reply that is not HTTP or is cut
short is a per-prompt FAIL (it was a traceback), and an answer with a NaN logprob, a token id
outside the vocabulary or a meta_info that is not an object is a per-prompt FAIL naming it (NaN
logprobs passed: NaN differences were dropped by max(); out-of-vocabulary ids stopped the whole
run with exit 2 blaming the runner's prefill; a null meta_info was an AttributeError)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from dsv4cp.tools.accuracy import compare_one, incomplete_answer, post_generate

VOCAB, TOP_K = 16, 2
PROMPT, TOKENS = [3, 4, 5], [7, 8]


class _Ref:
    """A runner stand-in whose greedy choice is the answer's token at every step."""

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB))

    def logprobs(self, prompt: list[int], forced: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.full((len(forced), VOCAB), -10.0)
        for i, t in enumerate(forced):
            rows[i, t] = -0.5
        return torch.full((len(prompt) - 1,), -1.0), rows


def _answer(**change: object) -> dict:
    meta = {
        "output_token_logprobs": [[-0.5, t, None] for t in TOKENS],
        "output_top_logprobs": [[[-0.5, t, None], [-10.0, 0, None]] for t in TOKENS],
        "input_token_logprobs": [[None, PROMPT[0], None]] + [[-1.0, t, None] for t in PROMPT[1:]],
        "input_top_logprobs": [None] + [[[-1.0, t, None], [-10.0, 0, None]] for t in PROMPT[1:]],
    }
    meta.update(change)
    return {"meta_info": meta}


def _compare(answer: dict) -> object:
    return compare_one(0, PROMPT, answer, _Ref(), 1e-3, TOP_K, len(TOKENS))  # type: ignore[arg-type]


def test_a_faithful_answer_passes() -> None:
    result = _compare(_answer())
    assert result.error is None and result.passed(1e-3)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"output_token_logprobs": [[float("nan"), t, None] for t in TOKENS]},
            "output_token_logprobs[0]: logprob nan is not a finite number",
        ),
        (
            {"output_top_logprobs": [[[float("inf"), t, None], [-10.0, 0, None]] for t in TOKENS]},
            "output_top_logprobs[0]: logprob inf is not a finite number",
        ),
        (
            {"output_token_logprobs": [[-0.5, -1, None], [-0.5, 8, None]]},
            "output_token_logprobs[0]: token id -1 is outside the vocabulary [0, 16)",
        ),
        (
            {"output_token_logprobs": [[-0.5, 7, None], [-0.5, 10**6, None]]},
            "output_token_logprobs[1]: token id 1000000 is outside the vocabulary [0, 16)",
        ),
        (
            {"input_token_logprobs": [[None, 3, None], [None, 4, None], [-1.0, 5, None]]},
            "input_token_logprobs[1]: logprob None is not a finite number",
        ),
        (
            {"output_token_logprobs": ["ab", "cd"]},
            "output_token_logprobs[0]: entry 'ab' is not [logprob, token id, ...]",
        ),
        ({"output_top_logprobs": 5}, "output_top_logprobs is int, not a list"),
    ],
)
def test_unusable_answers_fail_the_prompt(change: dict, message: str) -> None:
    result = _compare(_answer(**change))
    assert not result.passed(1e-3)  # type: ignore[attr-defined]
    assert result.error == f"malformed server answer: {message}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("meta", [None, [1], "x"])
def test_meta_info_that_is_not_an_object(meta: object) -> None:
    why = incomplete_answer(meta, prompt_len=3, new_tokens=2, top_k=TOP_K, vocab=VOCAB)
    assert why == f"malformed server answer: meta_info is {type(meta).__name__}, not an object"
    result = _compare({"meta_info": meta})
    assert result.error == why  # type: ignore[attr-defined]


@pytest.fixture
def bad_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A one-shot TCP server on 127.0.0.1 that sends `request.param` bytes and closes."""
    reply: bytes = request.param
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    t.join(5)
    srv.close()


@pytest.mark.parametrize(
    "bad_server,message",
    [
        (b"hello there\n", "BadStatusLine: hello there"),
        (
            b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"meta_info": {',
            "IncompleteRead: IncompleteRead(15 bytes read, 985 more expected)",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "IncompleteRead"),
    ],
    indirect=["bad_server"],
    ids=["not HTTP", "body cut short", "bad chunk"],
)
def test_a_reply_that_is_not_valid_http_is_a_connection_error(
    bad_server: str, message: str
) -> None:
    with pytest.raises(ConnectionError, match="not a valid HTTP answer") as info:
        post_generate(bad_server, {"input_ids": [1]}, timeout_s=10)
    assert message in str(info.value) and "\n" not in str(info.value)
