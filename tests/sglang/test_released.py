"""A real `sglang.launch_server --model-impl dsv4cp` on the released-format tiny checkpoint.

`tests/fixtures/dsv41-tiny-reference/checkpoint` is laid out like the released DeepSeek-V4.1
(fp8 weights with ue8m0 block scales, fp4 experts, Engram tables, a vision tower and DSpark
layers that dsv4cp skips); dsv4cp serves it with its whole model in `qat` numerics (the
checkpoint has a quantization_config) and quantized caches on SGLang's token slots.

Two servers, both on SGLang's hybrid-SWA pools (dsv4cp's SWA rows and ratio-2 pair state on
SGLang's SWA slots, freed outside the window of 16 tokens; docs/sglang.md, *Caches*):
- bf16 (the reference's dtype), dsv4cp's default `--swa-full-tokens-ratio` (409 SWA slots for
  4096 token slots): greedy outputs equal `PrefillRunner` on the same checkpoint (requests one
  at a time, chunked prefill, radix hits with their window held and a prefix hit whose window
  was freed), DeepSeek's reference outputs through `dsv4cp accuracy --reference` (prefill
  checks, greedy tokens up to a tie), the runner comparison of `dsv4cp accuracy`;
- fp32, `--swa-full-tokens-ratio 0.05 --page-size 16` (192 SWA slots; an even page size, so the
  ratio-2 pair state is indexed by swa_slot // 2 and its parity checked every forward): 32
  concurrent requests with shared prefixes (SWA eviction pressure) equal the same requests alone
  and the runner's batch, and malformed requests get 4xx while the server keeps answering
  identically.
  (Concurrency on CPU in bf16 is not bitwise batch-invariant: torch's vectorised and scalar
  CPU kernels of `sigmoid` differ in the last fp32 bit, so a token's hyper-connection mixes
  depend on how many rows share the call; rounded to bf16 and quantized to fp8 that can flip a
  code and, on this tiny random model, a later greedy token. fp32 keeps such differences below
  the fp8 rounding. Measured: 31/32 bf16, 32/32 fp32, server and runner alike.)
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.sglang.test_server import NEW_TOKENS, Server, _get_status, _greedy, _post

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference"
CKPT = FIXTURE / "checkpoint"
REFERENCE = FIXTURE / "reference_outputs.safetensors"
CONTEXT = 128  # the checkpoint's max_position_embeddings


def _server(dtype: str, tmp_path_factory: pytest.TempPathFactory, *extra: str):
    srv = Server(
        CKPT,
        tmp_path_factory.mktemp("logs") / f"released-{dtype}.log",
        extra=(
            "--model-impl",
            "dsv4cp",
            "--dtype",
            dtype,
            "--context-length",
            str(CONTEXT),
            *extra,
        ),
        env={"OMP_NUM_THREADS": "1"},  # a tiny model: threads cost more than they give
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory):
    yield from _server("bfloat16", tmp_path_factory)


@pytest.fixture(scope="module")
def fp32_server(tmp_path_factory: pytest.TempPathFactory):
    yield from _server(
        "float32", tmp_path_factory, "--swa-full-tokens-ratio", "0.05", "--page-size", "16"
    )


@pytest.fixture(scope="module")
def runner_of():
    """dtype → generate(prompts, n): dsv4cp's runner on the same checkpoint, qat numerics."""
    import torch

    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.runner import PrefillRunner

    models: dict[str, DeepseekV41Model] = {}

    def get(dtype: str):
        if dtype not in models:
            models[dtype] = DeepseekV41Model.from_checkpoint(
                CKPT, quant="qat", dtype=getattr(torch, dtype)
            )
        model = models[dtype]

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            runner = PrefillRunner(model, num_slots=8192, max_requests=64, max_context=CONTEXT)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # 2-5x faster on this tiny model; bitwise the same
            try:
                return runner.generate(prompts, n)
            finally:
                torch.set_num_threads(threads)

        return generate

    return get


def _reference() -> dict:
    from safetensors.torch import load_file

    return load_file(str(REFERENCE))


def _ids(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _flush(server: Server) -> None:
    """Empty the radix cache (SGLang answers plain text; no request may be in flight)."""
    req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200 and b"Cache flushed" in resp.read()


# ------------------------------------------------------------------------------------- bf16
def test_accuracy_against_reference_and_runner(bf16_server: Server) -> None:
    """`dsv4cp accuracy --reference`: one-shot prefill from an empty cache (flushed: the
    warm-up request shares the BOS token), DeepSeek's reference outputs, and the runner."""
    _flush(bf16_server)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4cp",
            "accuracy",
            "--base-url",
            bf16_server.url,
            "--model-path",
            str(CKPT),
            "--reference",
            str(REFERENCE),
            "--max-new-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    checks = {c["name"]: c for c in report["reference"]["checks"]}
    print(json.dumps(checks, indent=1))  # the measured numbers (docs/sglang.md)
    for name in (
        "one-shot prefill (cached tokens)",
        "prompt ids echoed",
        "prefill top-1 agreement",
        "prefill top-k logprob rms",
        "prompt-token logprob rms",
        "greedy tokens",
    ):
        assert checks[name]["passed"], checks[name]
    # "decode top-k logprob rms" is reported, not judged (0.23 nats measured: dsv4cp's model,
    # runner and server alike, differs from the reference's decode at position 62; docs/sglang.md).
    assert not checks["decode top-k logprob rms"]["judged"]
    assert report["reference"]["passed"], res.stdout
    assert report["runner"]["passed"], res.stdout


def test_reference_greedy_tokens(bf16_server: Server) -> None:
    """The reference's `decoded_ids` for its prompt, compared as its README says: equal up to
    the first step where the reference's own top two are a tie (0.05 nats)."""
    import torch

    ref = _reference()
    _flush(bf16_server)
    prompt = ref["input_ids"][0].tolist()
    want = ref["decoded_ids"][0].tolist()
    out = _greedy(bf16_server, prompt, len(want))
    assert out["meta_info"]["cached_tokens"] == 0
    got = out["output_ids"]
    dists = [torch.log_softmax(ref["full_logits"][0, -1].float(), -1)]
    dists += list(torch.log_softmax(ref["decode_logits"].float(), -1))
    compared = 0
    for tok, w, lp in zip(got, want, dists):
        top = lp.topk(2).values
        if float(top[0] - top[1]) <= 0.05:  # the reference is defined only up to this tie
            break
        assert tok == w, (got, want)
        compared += 1
    assert compared >= 2, (got, want)


def test_greedy_matches_runner(bf16_server: Server, runner_of) -> None:
    """One request at a time (bitwise the runner's single requests): the reference prompt, a
    short one, a chunked one (> --chunked-prefill-size 64) decoding 40 tokens (SWA slots of
    tokens older than the window of 16 freed and reused), radix hits whose window is held (the
    first chunk's end, 64 tokens; a whole earlier request, 53 tokens: an odd prefix, its ratio-2
    partner read from the pair state), and a prefix whose window was freed: SGLang's full slots
    still hold the reference prompt's first 40 tokens, its SWA slots do not, so the hit is
    shorter and the rest is recomputed."""
    ref_prompt = _reference()["input_ids"][0].tolist()
    long, head = _ids(80, 3), ref_prompt[:40] + _ids(6, 5)
    generate = runner_of("bfloat16")

    def check(p: list[int], n: int) -> tuple[list[int], int]:
        out = _greedy(bf16_server, p, n)
        assert out["output_ids"] == generate([p], n)[0], f"len {len(p)}"
        return out["output_ids"], out["meta_info"]["cached_tokens"]

    check(ref_prompt, NEW_TOKENS)
    check(_ids(9, 2), NEW_TOKENS)
    check(long, 40)
    assert check(long[:64] + _ids(7, 4), NEW_TOKENS)[1] == 64
    head_out, cached = check(head, NEW_TOKENS)
    assert cached < 40, "the prefix's window was freed: no hit at 40"
    # the earlier request's prompt and outputs but its last (no KV yet): 46 + 7 = 53 tokens
    assert check(head + head_out + _ids(2, 6), NEW_TOKENS)[1] == 53
    log = bf16_server.log_path.read_text(errors="replace")
    assert "dsv4cp: released-format checkpoint, quant=qat" in log
    assert "KV cache of" in log and "(qat numerics)" in log
    # SGLang's hybrid-SWA pools: 409 SWA slots (4096 x 0.1), dsv4cp's SWA rows on them
    assert "swa size: 409, full size: 4096" in log
    assert "SWA rows 411 (qat numerics)" in log
    assert "skipping 169 DSpark tensors" in log and "25 vision tensors" in log


# ------------------------------------------------------------------------------------- fp32
def test_concurrent_requests_with_shared_prefixes(fp32_server: Server, runner_of) -> None:
    """32 requests in flight, 8 on each of 4 shared prefixes (odd and even lengths, one equal
    to the chunk size), equal the same requests alone and the runner's batch. Concurrently
    first, on a flushed cache, so that prefixes are shared inside batches; the SWA pool fills
    (SGLang queues, evicts the radix cache's SWA slots and retracts requests), and the
    requests sent alone afterwards hit prefixes whose SWA slots were evicted and reused."""
    _flush(fp32_server)
    prefixes = [_ids(n, 200 + n) for n in (17, 30, 41, 64)]
    prompts = [p + _ids(1 + (5 * i) % 12, 300 + i) for p in prefixes for i in range(8)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda p: _greedy(fp32_server, p, 4)["output_ids"], prompts))
    alone = [_greedy(fp32_server, p, 4)["output_ids"] for p in prompts]
    assert together == alone
    assert alone == runner_of("float32")(prompts, 4)
    # under SWA pressure: 192 SWA slots (4096 x 0.05 in pages of 16; dsv4cp's pool adds two
    # pages) for ~1,500 prompt tokens in flight
    log = fp32_server.log_path.read_text(errors="replace")
    assert "swa size: 192, full size: 4096" in log and "SWA rows 224 (qat numerics)" in log
    # SGLang logs the SWA usage once per logged batch, so the peak between two lines is unseen:
    # CI runs logged peaks of 0.83 to 1.0 for the same requests (scheduling timing). The check is
    # that the pool was at least half full at a sampled point, i.e. the requests did contend.
    usage = [float(u) for u in re.findall(r"swa token usage: ([0-9.]+)", log)]
    assert max(usage) >= 0.5, usage


BASELINE_PROMPT = [5, 6, 7]
GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture(scope="module")
def baseline(fp32_server: Server, runner_of) -> list[int]:
    out = _greedy(fp32_server, BASELINE_PROMPT, NEW_TOKENS)["output_ids"]
    assert out == runner_of("float32")([BASELINE_PROMPT], NEW_TOKENS)[0]
    return out


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        {"input_ids": [1, 2, 256], "sampling_params": {"max_new_tokens": 2}},  # vocab is 256
        {"input_ids": [1.5, 2], "sampling_params": {"max_new_tokens": 2}},
        {"input_ids": ["5", "6"], "sampling_params": {"max_new_tokens": 2}},
        {"input_ids": list(range(3, 130)), "sampling_params": {"max_new_tokens": 2}},
        {**GEN, "return_logprob": True, "logprob_start_len": -5},
        {**GEN, "return_logprob": True, "top_logprobs_num": 1000},
        {"input_embeds": [[0.5] * 128] * 3, "sampling_params": {"max_new_tokens": 4}},
        {**GEN, "image_data": "http://127.0.0.1:1/x.png"},
    ],
    ids=[
        "bad-json",
        "id-is-vocab",
        "float-ids",
        "string-ids",
        "over-context",
        "logprob-start-below-minus-one",
        "top-logprobs-above-vocab",
        "input-embeds",
        "image-data",
    ],
)
def test_malformed_request_is_4xx(
    fp32_server: Server, baseline: list[int], body: bytes | dict
) -> None:
    status, out = _post(fp32_server.url + "/generate", body)
    assert 400 <= status < 500, (status, out)
    assert _get_status(fp32_server.url + "/health") == 200, fp32_server.log_tail()
    assert _greedy(fp32_server, BASELINE_PROMPT, NEW_TOKENS)["output_ids"] == baseline
