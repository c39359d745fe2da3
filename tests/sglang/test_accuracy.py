"""`dsv4cp accuracy` against scripted servers: reference mode, incomplete answers, CLI errors.

A local HTTP server answers `/generate` with a body the test builds. The reference answers are
made from DeepSeek's reference outputs themselves (the fixture), so a faithful server passes and
each perturbation must fail the check it targets. The live-server PASS of the runner comparison
is in test_server.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dsv4cp.cli import main
from dsv4cp.tools.accuracy_reference import (
    ReferenceOutputs,
    ReferenceTolerance,
    compare_reference,
    run_reference,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference"
REFERENCE = FIXTURE / "reference_outputs.safetensors"
TOP_K = 5


@pytest.fixture
def fake_server() -> Iterator[Callable[[Callable[[dict], object]], str]]:
    """start(answer) -> base URL of a server replying answer(request body) as JSON."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Callable[[dict], object]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps(answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _top(row: torch.Tensor, k: int) -> list[list]:
    vals, ids = row.topk(k)
    return [[float(v), int(i), None] for v, i in zip(vals, ids)]


def _faithful_answer(ref: ReferenceOutputs, k: int = TOP_K) -> dict:
    """What a server computing exactly the reference returns (SGLang's answer layout)."""
    lp, prompt = ref.prefill_lp, ref.prompt
    steps = [lp[-1], *ref.decode_lp]
    return {
        "output_ids": list(ref.decoded),
        "meta_info": {
            "cached_tokens": 0,
            "input_token_logprobs": [[None, prompt[0], None]]
            + [[float(lp[j, t]), t, None] for j, t in enumerate(prompt[1:])],
            "input_top_logprobs": [None] + [_top(lp[j], k) for j in range(len(prompt) - 1)],
            "output_token_logprobs": [[float(r[t]), t, None] for r, t in zip(steps, ref.decoded)],
            "output_top_logprobs": [_top(r, k) for r in steps],
        },
    }


@pytest.fixture(scope="module")
def ref() -> ReferenceOutputs:
    return ReferenceOutputs.load(REFERENCE)


def _checks(answer: dict, ref: ReferenceOutputs) -> dict[str, bool]:
    report = compare_reference(answer, ref, top_k=TOP_K, tol=ReferenceTolerance())
    return {c.name: c.passed for c in report.checks}


def test_faithful_server_passes_every_reference_check(ref: ReferenceOutputs, fake_server) -> None:
    url = fake_server(lambda body: _faithful_answer(ref))
    report = run_reference(url, REFERENCE, top_k=TOP_K)
    assert report.passed, report.table()
    assert len(report.checks) == 7


def test_the_request_asks_for_what_is_compared(ref: ReferenceOutputs, fake_server) -> None:
    seen: list[dict] = []
    url = fake_server(lambda body: seen.append(body) or _faithful_answer(ref))
    run_reference(url, REFERENCE, top_k=TOP_K)
    (body,) = seen
    assert body["input_ids"] == ref.prompt and body["logprob_start_len"] == 0
    assert body["top_logprobs_num"] == TOP_K and body["return_logprob"] is True
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == len(ref.decoded) and sp["temperature"] == 0.0
    assert sp["ignore_eos"] is True


def test_logprob_offset_fails_the_rms_checks(ref: ReferenceOutputs) -> None:
    ans = _faithful_answer(ref)
    meta = ans["meta_info"]
    for rows in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        for e in rows:
            e[0] += 0.2  # 4x the rms limit
    checks = _checks(ans, ref)
    assert not checks["prefill top-k logprob rms"] and not checks["decode top-k logprob rms"]
    assert checks["prefill top-1 agreement"] and checks["prompt-token logprob rms"]


def test_swapped_top1_fails_the_agreement_check(ref: ReferenceOutputs) -> None:
    ans = _faithful_answer(ref)
    tops = ans["meta_info"]["input_top_logprobs"]
    gaps = [float(ref.prefill_lp[j].topk(2).values.diff().abs()) for j in range(len(tops) - 1)]
    clear = [j for j, g in enumerate(gaps) if g > 0.05][: len(gaps) // 5]  # 20 %: quant-off
    assert len(clear) >= 10
    for j in clear:
        row = tops[j + 1]
        row[0], row[1] = row[1], row[0]
    assert not _checks(ans, ref)["prefill top-1 agreement"]


def test_greedy_token_off_the_reference_fails(ref: ReferenceOutputs) -> None:
    ans = _faithful_answer(ref)
    lp = ref.decode_lp[0]
    worst = int(lp.argmin())  # far from a tie
    ans["meta_info"]["output_token_logprobs"][1][1] = worst
    assert not _checks(ans, ref)["greedy tokens"]


@pytest.mark.parametrize("damage", ["no tokens", "short", "no top-k", "cached", "other prompt"])
def test_incomplete_or_unfit_answers_fail(ref: ReferenceOutputs, damage: str) -> None:
    ans = _faithful_answer(ref)
    meta = ans["meta_info"]
    if damage == "no tokens":  # reliability probe D5: a 200 with nothing generated
        meta["output_token_logprobs"], meta["input_token_logprobs"] = [], []
    elif damage == "short":
        meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
    elif damage == "no top-k":
        meta["output_top_logprobs"][2] = meta["output_top_logprobs"][2][:2]
    elif damage == "cached":
        meta["cached_tokens"] = 32
    else:
        meta["input_token_logprobs"][5][1] += 1
    report = compare_reference(ans, ref, top_k=TOP_K, tol=ReferenceTolerance())
    assert not report.passed, report.table()


def test_runner_comparison_fails_an_empty_answer(
    tmp_path: Path, fake_server, capsys: pytest.CaptureFixture
) -> None:
    from dsv4cp.tools.export_tiny import export_tiny

    ckpt = export_tiny(tmp_path / "ckpt", seed=0)
    url = fake_server(
        lambda body: {"meta_info": {"output_token_logprobs": [], "input_token_logprobs": []}}
    )
    rc = main(["accuracy", "--base-url", url, "--model-path", str(ckpt), "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "server returned 0 tokens, asked for 2" in out and "FAIL: 0/6" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-path", "/nonexistent/ckpt"], "no tokenizer.json"),
        (["--model-path", ".", "--skip-runner"], "needs --reference"),
        (
            ["--model-path", ".", "--reference", "/nonexistent.safetensors", "--skip-runner"],
            "no reference outputs file",
        ),
    ],
)
def test_cli_input_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    rc = main(["accuracy", "--base-url", "http://127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv", [["--atol", "-1"], ["--atol", "nan"], ["--timeout", "0"], ["--ref-max-rms", "inf"]]
)
def test_cli_rejects_bad_numbers(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["accuracy", "--base-url", "http://x", "--model-path", ".", *argv])
    assert e.value.code == 2


def test_decode_rms_is_reported_and_judged_only_when_asked(ref: ReferenceOutputs) -> None:
    """The fixture's decode logits are the reference's decode path (README: report, not match):
    a decode-only offset shows in the table but fails the verdict only with judge_decode."""
    ans = _faithful_answer(ref)
    for rows in ans["meta_info"]["output_top_logprobs"][1:]:
        for e in rows:
            e[0] += 0.2
    report = compare_reference(ans, ref, top_k=TOP_K, tol=ReferenceTolerance())
    (decode,) = [c for c in report.checks if c.name == "decode top-k logprob rms"]
    assert not decode.passed and not decode.judged and report.passed
    assert "not judged (information)" in report.table()
    judged = compare_reference(ans, ref, top_k=TOP_K, tol=ReferenceTolerance(judge_decode=True))
    assert not judged.passed
