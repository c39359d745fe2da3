"""A server whose token pools are too small for its load: SGLang 0.5.23 retracts decoding
requests (frees their slots, dsv4cp's cache rows with them) and prefills them again later. Every
answer must still equal dsv4cp's runner, and the retraction must have happened (else the test
proves nothing). The pools: 1024 token slots and SGLang's hybrid-SWA pool at dsv4cp's default
ratio 0.1 (~102 SWA slots, above one window plus one 64-token chunk, so no start-up warning)."""

from __future__ import annotations

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sglang.test_server import Server, _ids, _post

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

NEW_TOKENS = 48
PROMPTS = [_ids(40 + 7 * i, 500 + i) for i in range(10)]  # 10 × ~120 tokens in flight > 1024


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory: pytest.TempPathFactory):
    from dsv4cp.tools.export_tiny import export_tiny

    ckpt = export_tiny(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)
    srv = Server(
        ckpt,
        tmp_path_factory.mktemp("logs") / "server.log",
        extra=("--max-total-tokens", "1024"),  # the later flag wins over the suite's 4096
    )
    try:
        srv.wait_healthy()
        yield srv, ckpt
    finally:
        srv.kill()


def _greedy(server: Server, prompt: list[int]) -> tuple[int, dict | str]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    return _post(server.url + "/generate", body, timeout=600.0)


def test_retracted_requests_answer_as_the_runner(small_pool_server) -> None:
    server, ckpt = small_pool_server
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _greedy(server, p), PROMPTS))
    assert [status for status, _ in answers] == [200] * len(PROMPTS), answers

    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.runner import PrefillRunner

    runner = PrefillRunner(
        DeepseekV41Model.from_pretrained(ckpt), num_slots=16384, max_requests=64, max_context=1024
    )
    want = runner.generate(PROMPTS, NEW_TOKENS)
    for i, ((_, out), expect) in enumerate(zip(answers, want)):
        assert isinstance(out, dict) and out["output_ids"] == expect, f"request {i}"

    log = server.log_path.read_text(errors="replace")
    retracted = [int(n) for n in re.findall(r"#retracted_reqs: (\d+)", log)]
    assert sum(retracted) >= 1, "no request was retracted: the pools did not run out"
    assert "SWA pool holds" not in log  # ~102 SWA slots: one window + one chunk fit
