"""`dsv4cp accuracy` against servers that answer badly: a reply that is not HTTP or is cut
short is a per-prompt FAIL (it was a traceback), and an answer with a NaN logprob, a token id
outside the vocabulary or a meta_info that is not an object is a per-prompt FAIL naming it (NaN
logprobs passed: NaN differences were dropped by max(); out-of-vocabulary ids stopped the whole
run with exit 2 blaming the runner's prefill; a null meta_info was an AttributeError)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from dsv4cp.cli import main
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
            data = b""  # the whole request first: unread bytes at close would reset the socket
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            while len(body) < length:
                body += conn.recv(65536)
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


def _reference_file(tmp_path: Path, **change: torch.Tensor) -> Path:
    from tests.model import dsv41_fixture as fx

    ref = {**fx.reference(), **change}
    path = tmp_path / "reference.safetensors"
    save_file({k: v.contiguous() for k, v in ref.items()}, str(path))
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("not safetensors", "not a safetensors file (Error while deserializing header"),
        ("NaN logits", "full_logits holds NaN or inf"),
        ("float decoded ids", "decoded_ids must be integer, got torch.float32"),
        ("bool input ids", "input_ids must be integer, got torch.bool"),
        ("empty prompt", "input_ids (1, 0) and full_logits (1, 0, 256) must be [1, P]"),
    ],
)
def test_accuracy_reference_file_is_checked(
    case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`accuracy --reference FILE`: a file that is not safetensors was a SafetensorError
    traceback; NaN logits, float or bool ids and an empty prompt were accepted."""
    from tests.model import dsv41_fixture as fx

    full = fx.reference()["full_logits"].clone()
    full[0, 3, 0] = float("nan")
    ids = fx.reference()["input_ids"]
    if case == "not safetensors":
        path = tmp_path / "junk"
        path.write_text("not a safetensors file\n")
    else:
        path = _reference_file(
            tmp_path,
            **{
                "NaN logits": {"full_logits": full},
                "float decoded ids": {"decoded_ids": fx.reference()["decoded_ids"].float()},
                "bool input ids": {"input_ids": ids.bool()},
                "empty prompt": {"input_ids": ids[:, :0], "full_logits": full[:, :0]},
            }[case],
        )
    argv = ["accuracy", "--base-url", "http://127.0.0.1:1", "--model-path", str(tmp_path)]
    rc = main([*argv, "--reference", str(path), "--skip-runner"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.startswith(f"dsv4cp accuracy: {path}: ") and err.count("\n") == 1, err
    assert message in err, err


def _health_server(status: int) -> tuple[str, object]:
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv


def test_no_server_or_one_still_starting_is_said_before_any_prompt() -> None:
    """Nothing listening used to be six per-prompt rows of `Connection refused` and a FAIL that
    read like a numerics failure, after the runner had been built (minutes on CPU)."""
    from dsv4cp.tools.accuracy import check_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening
        with pytest.raises(ConnectionError, match=f"no server answers at {dead}"):
            check_server(dead, 5.0)
    url, srv = _health_server(503)
    try:
        with pytest.raises(ConnectionError, match="not ready yet"):
            check_server(url, 5.0)
    finally:
        srv.shutdown()  # type: ignore[attr-defined]
    for status in (200, 404):  # up, or a server without /health: the prompts judge it
        url, srv = _health_server(status)
        try:
            check_server(url, 5.0)
        finally:
            srv.shutdown()  # type: ignore[attr-defined]


def test_cli_says_no_server_in_one_line(capsys: pytest.CaptureFixture) -> None:
    fixture = Path(__file__).resolve().parent / "fixtures" / "dsv41-tiny-reference" / "checkpoint"
    rc = main(["accuracy", "--base-url", "http://127.0.0.1:1", "--model-path", str(fixture)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("dsv4cp accuracy: no server answers at http://127.0.0.1:1 (")
