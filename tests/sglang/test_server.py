"""A real `python -m sglang.launch_server` on CPU serving an exported tiny dsv4cp checkpoint.

Checks greedy output against dsv4cp's own runner (lengths across the chunked-prefill size, a
radix-cache hit), 32 concurrent requests with shared prefixes against the same requests sent
alone, malformed requests on /generate and the OpenAI endpoints (4xx, among them those that
killed SGLang 0.5.23's scheduler; the server keeps answering identically), `dsv4cp accuracy`,
clean shutdown on SIGTERM and SIGINT, and unsupported flags refused at startup in one line (on
the released-format fixture with `--model-impl dsv4cp`; that checkpoint's serving tests are in
test_released.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(420),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

CHUNK = 64  # --chunked-prefill-size: the 150-token prompt takes three chunks
STARTUP_S = 300.0
SHUTDOWN_S = 30.0
NEW_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes | dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _get_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _launch_cmd(model_path: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--context-length",
        "1024",
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        str(CHUNK),
        "--log-level",
        "info",
        *extra,
    ]


def _launch_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SGLANG_EXTERNAL_MODEL_PACKAGE", None)
    return env


class Server:
    def __init__(
        self,
        model_path: Path,
        log_path: Path,
        *,
        warmup: bool = True,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        from importlib.metadata import entry_points

        plugins = entry_points(group="sglang.srt.plugins")
        if not any(ep.value.startswith("dsv4cp.") for ep in plugins):
            pytest.fail(
                "the dsv4cp sglang.srt.plugins entry point is not installed "
                "(pip install -e . in this environment)"
            )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # Page size 1: radix prefixes of any length, here an odd one (91 tokens), are shared.
        cmd = _launch_cmd(model_path, self.port, "--page-size", "1", *extra)
        if not warmup:
            cmd.append("--skip-server-warmup")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**_launch_env(), **(env or {})},
            start_new_session=True,
        )

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def wait_healthy(self, deadline_s: float = STARTUP_S) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _get_status(self.url + "/health") == 200:
                    return
            time.sleep(1.0)
        self.kill()
        pytest.fail(f"server not healthy after {deadline_s:.0f}s:\n{self.log_tail()}")

    def stop(self, sig: int, deadline_s: float = SHUTDOWN_S) -> tuple[float, list[int]]:
        """Send `sig`; return (seconds to exit, pids of descendants still alive)."""
        import psutil

        kids = psutil.Process(self.proc.pid).children(recursive=True)
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"server ignored signal {sig} for {deadline_s:.0f}s:\n{self.log_tail()}")
        took = time.monotonic() - t0
        _, alive = psutil.wait_procs(kids, timeout=max(1.0, deadline_s - took))
        return took, [p.pid for p in alive]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4cp.tools.export_tiny import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    # SGLang's every-slot pools (the fallback): an SWA row per token slot, so radix prefixes of
    # any length are shared, here an odd one (91 tokens; test_released.py runs hybrid SWA)
    srv = Server(
        checkpoint,
        tmp_path_factory.mktemp("logs") / "server.log",
        extra=("--disable-hybrid-swa-memory",),
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    from dsv4cp.model import DeepseekV41Model

    model = DeepseekV41Model.from_pretrained(checkpoint)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        from dsv4cp.runner import PrefillRunner

        runner = PrefillRunner(model, num_slots=16384, max_requests=64, max_context=1024)
        return runner.generate(prompts, n)

    return generate


def _ids(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _greedy(server: Server, prompt: list[int] | str, n: int) -> dict:
    body = {"sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
    body["text" if isinstance(prompt, str) else "input_ids"] = prompt
    status, out = _post(server.url + "/generate", body)
    assert status == 200, out
    return out


# ---------------------------------------------------------------------------------- tests
def test_greedy_matches_runner(server: Server, checkpoint: Path, reference) -> None:
    from dsv4cp.tools.accuracy import load_tokenizer

    text = "Hello from dsv4cp"
    long = _ids(150, 1)  # > CHUNK: chunked prefill
    prompts: list[list[int] | str] = [text, _ids(9, 2), _ids(40, 3), long, long[:91] + _ids(20, 4)]
    ids = [load_tokenizer(checkpoint).encode(text, add_special_tokens=False).ids] + prompts[1:]
    expect = reference(ids, NEW_TOKENS)
    outs = [_greedy(server, p, NEW_TOKENS) for p in prompts]  # in order: the last hits the cache
    for i, (out, want) in enumerate(zip(outs, expect)):
        assert out["output_ids"] == want, f"prompt {i} (len {len(ids[i])})"
        assert out["meta_info"]["prompt_tokens"] == len(ids[i])
    assert outs[-1]["meta_info"]["cached_tokens"] >= CHUNK, "no radix-cache hit on the prefix"
    log = server.log_path.read_text(errors="replace")
    assert "SWAKVPool" not in log and "SWA rows per slot" in log


def test_concurrent_requests_with_shared_prefixes(server: Server, reference) -> None:
    """32 requests in flight at once, 8 on each of 4 shared prefixes (odd and even lengths,
    one crossing the chunk size), equal the same requests sent one at a time, and the runner.
    Concurrently first, on a cold cache, so that the prefixes are shared inside batches."""
    prefixes = [_ids(n, 200 + n) for n in (37, 50, 64, 91)]
    prompts = [p + _ids(1 + (5 * i) % 12, 300 + i) for p in prefixes for i in range(8)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda p: _greedy(server, p, 4)["output_ids"], prompts))
    alone = [_greedy(server, p, 4)["output_ids"] for p in prompts]
    assert together == alone
    assert alone == reference(prompts, 4)


BASELINE_PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def baseline(server: Server, reference) -> list[int]:
    """The server's greedy answer before any malformed request (and the runner's)."""
    out = _greedy(server, BASELINE_PROMPT, NEW_TOKENS)["output_ids"]
    assert out == reference([BASELINE_PROMPT], NEW_TOKENS)[0]
    return out


def _still_serving(server: Server, baseline: list[int]) -> None:
    assert _get_status(server.url + "/health") == 200, server.log_tail()
    assert _greedy(server, BASELINE_PROMPT, NEW_TOKENS)["output_ids"] == baseline


GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}


def _gen_with(**sampling: object) -> dict:
    """GEN with `sampling` added to its sampling_params."""
    return {**GEN, "sampling_params": {**GEN["sampling_params"], **sampling}}


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        {"input_ids": "abc"},
        {"sampling_params": {"max_new_tokens": 2}},
        {"input_ids": [1, 2, 99999], "sampling_params": {"max_new_tokens": 2}},
        {"input_ids": [-1, 5], "sampling_params": {"max_new_tokens": 2}},
        {"text": "", "sampling_params": {"max_new_tokens": 2}},
        {"text": "hi", "sampling_params": {"max_new_tokens": -3}},
        {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5000}},
        # These killed SGLang 0.5.23's scheduler (and the server) before dsv4cp's checks:
        {**GEN, "return_logprob": True, "logprob_start_len": -5},
        {**GEN, "return_logprob": True, "top_logprobs_num": 1_000_000},
        {**GEN, "return_logprob": True, "logprob_start_len": [0]},
        _gen_with(min_new_tokens=2, stop_token_ids=[600]),
        _gen_with(top_k=2**31),
        # Sampled token 0 at every step before dsv4cp's checks (1e39 is infinite in float32):
        _gen_with(logit_bias={"9": 1e39}),
        # 500 before dsv4cp's checks:
        {**GEN, "rid": ["a", "b"]},
        {"input_ids": [[5, 6], [7, 8]], "token_ids_logprob": [[1]], "return_logprob": True},
        {"input_ids": [[5, 6], [7, 8]], "custom_logit_processor": [None]},
        {"input_ids": [[5, 6], [7, 8]], "bootstrap_host": ["h"], "bootstrap_room": [1]},
        {"input_ids": [[5, 6], [7, 8]], "lora_path": ["adapter"]},
        # Queued 100,000 sequences (the server answered nothing else for minutes); served as 1:
        _gen_with(n=100_000),
        _gen_with(n=-2),
        # 500 before dsv4cp's checks (SGLang's own check / normalisation raised):
        {**GEN, "sampling_params": [{"max_new_tokens": 4}]},
        _gen_with(stop_regex="[a-"),
        _gen_with(stop_regex="a{4294967296}"),
        # Sampled token 0 with null logprobs after the first step (penalty 0 in float32):
        {**_gen_with(temperature=1.0, repetition_penalty=1e-40), "return_logprob": True},
        # Matched at once: every answer empty:
        _gen_with(stop=["", "a"]),
        # Accepted, then ignored or not honoured by the model, before dsv4cp's checks:
        {**GEN, "return_logprob": True, "top_logprobs_num": -1},
        {**GEN, "image_data": "http://127.0.0.1:1/x.png"},
        {**GEN, "return_routed_experts": True},
    ],
    ids=[
        "bad-json",
        "ids-type",
        "no-prompt",
        "id-too-large",
        "id-negative",
        "empty-text",
        "negative-max-new",
        "over-context",
        "logprob-start-below-minus-one",
        "top-logprobs-above-vocab",
        "logprob-start-list",
        "stop-token-oov-min-new",
        "top-k-above-int32",
        "logit-bias-overflow",
        "rid-list-single-prompt",
        "batch-token-ids-logprob-short",
        "batch-logit-processor-short",
        "batch-bootstrap-short",
        "batch-lora-short",
        "n-huge",
        "n-negative",
        "sampling-params-list-single-prompt",
        "stop-regex-invalid",
        "stop-regex-overflow",
        "repetition-penalty-underflow",
        "stop-empty-string",
        "top-logprobs-negative",
        "image-data",
        "routed-experts",
    ],
)
def test_malformed_request_is_4xx(server: Server, baseline: list[int], body: bytes | dict) -> None:
    status, out = _post(server.url + "/generate", body)
    assert 400 <= status < 500, (status, out)
    _still_serving(server, baseline)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # 500 before dsv4cp's checks (the tokenizer's decode, SGLang's stop_regex parse):
        ("/v1/detokenize", {"tokens": [-1]}),
        ("/v1/detokenize", {"tokens": [[5], [2**40]]}),
        ("/v1/chat/completions", {**CHAT, "stop_regex": "(("}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stop_regex": "(("}),
        # Served before dsv4cp's checks: 0 was dropped, the answer ran to the context length
        ("/v1/chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 0}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
        # Sampled token 0 (penalty 0 in float32) / every answer empty (stop ""):
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-300}),
        ("/v1/chat/completions", {**CHAT, "stop": ""}),
    ],
    ids=[
        "detokenize-negative",
        "detokenize-huge",
        "chat-stop-regex-invalid",
        "completions-stop-regex-invalid",
        "chat-max-completion-tokens-zero",
        "chat-max-tokens-zero",
        "completions-repetition-penalty-underflow",
        "chat-stop-empty",
    ],
)
def test_malformed_openai_request_is_4xx(
    server: Server, baseline: list[int], path: str, body: dict
) -> None:
    status, out = _post(server.url + path, body)
    assert 400 <= status < 500, (status, out)
    _still_serving(server, baseline)


def test_accuracy_cli(server: Server, checkpoint: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4cp",
            "accuracy",
            "--base-url",
            server.url,
            "--model-path",
            str(checkpoint),
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout
    assert "accuracy: prompt 6/6" in res.stderr  # progress while the runner compares


def test_shutdown_sigterm(server: Server) -> None:
    took, alive = server.stop(signal.SIGTERM)
    assert server.proc.returncode is not None
    assert not alive, f"children left after SIGTERM: {alive}"
    assert took < SHUTDOWN_S


def test_shutdown_sigint(checkpoint: Path, tmp_path: Path) -> None:
    srv = Server(checkpoint, tmp_path / "server.log", warmup=False)
    try:
        srv.wait_healthy()
        assert len(_greedy(srv, [1, 2, 3], 2)["output_ids"]) == 2
        took, alive = srv.stop(signal.SIGINT)
        assert not alive, f"children left after SIGINT: {alive}"
        assert took < SHUTDOWN_S
    finally:
        srv.kill()


# ----------------------------------------------- a released checkpoint, flags refused at startup
RELEASED = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference" / "checkpoint"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            (
                "--model-impl",
                "dsv4cp",
                "--tp",
                "2",
                "--enable-prefill-cp",
                "--cp-strategy",
                "zigzag",
            ),
            "dsv4cp: --cp-strategy zigzag is not supported yet; use --cp-strategy interleave",
        ),
        (
            ("--model-impl", "dsv4cp", "--json-model-override-args", '{"dsv4cp_quant": "fp8"}'),
            'dsv4cp: dsv4cp_quant must be "qat" or "none", got \'fp8\'',
        ),
        (
            ("--model-impl", "dsv4cp", "--tp", "2"),
            "dsv4cp: --tp 2 needs --enable-prefill-cp --cp-strategy interleave: "
            "dsv4cp has no tensor parallelism, its ranks split the prompt tokens (CP)",
        ),
    ],
)
def test_unsupported_flags_fail_at_startup_in_one_line(
    flags: tuple[str, ...], message: str
) -> None:
    res = subprocess.run(
        _launch_cmd(RELEASED, _free_port(), *flags),
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
        env=_launch_env(),
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"sglang serve: error: {message}"
    assert "Traceback" not in res.stderr + res.stdout
