"""Multistream prepare (CUDA): bit-identical to the serial executor for every layer role, under
FakeCPGroup CP ∈ {1, 2, 4}, with random delays injected at the start of every lane, and with no
memory growth across forwards."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.kernels import indexer_topk
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.tools.checking import recording

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = {"a": 130, "b": 37, "c": 5}
PREFIX = {"a": 40, "b": 0, "c": 2}


def _prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randint(0, vocab, (n,), generator=g).tolist() for k, n in PROMPTS.items()}


def _run(group, multistream: bool, dtype_name: str, sleep: bool, reps: int):  # noqa: ANN001
    cfg = DeepseekV41Config.tiny()
    dtype = getattr(torch, dtype_name)
    model = DeepseekV41Model(cfg, dtype=dtype, device="cuda", seed=5)
    prompts = _prompts(cfg.vocab_size)
    outs = []
    for rep in range(reps):
        runner = PrefillRunner(model, cp=group, multistream=multistream, num_slots=1024)
        if sleep:
            rng = random.Random(1000 * rep + group.rank)
            runner.executors = runner.executors.with_lane_hook(
                lambda lane, rng=rng: torch.cuda._sleep(rng.randint(0, 200_000))
            )
        pre = {k: p[: PREFIX[k]] for k, p in prompts.items() if PREFIX[k]}
        runner.prefill(pre)
        with recording(model) as recorder:
            out = runner.prefill(
                {k: p[PREFIX[k] :] for k, p in prompts.items()}, return_all_logits=True
            )
        layers, topk = recorder.gathered()
        caches = {k: v.clone() for k, v in runner.cache.state_dict_view().items()}
        outs.append((out.all_logits, layers, topk, caches))
    torch.cuda.synchronize()
    return outs if group.rank == 0 else None


def _equal(a, b) -> None:  # noqa: ANN001
    la, ha, ta, ca = a
    lb, hb, tb, cb = b
    assert torch.equal(la, lb)
    for k in ha:
        assert torch.equal(ha[k], hb[k]), k
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    for k in ca:  # slot 0 is the dummy slot: padding and non-emitting rows all write there
        assert torch.equal(ca[k][1:], cb[k][1:]), k


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multistream_bit_identical_to_serial(cp: int, dtype: str) -> None:
    serial = run_cp(cp, _run, False, dtype, False, 1, backend="fake")[0]
    multi = run_cp(cp, _run, True, dtype, False, 1, backend="fake")[0]
    _equal(serial[0], multi[0])


def test_multistream_bit_identical_to_serial_on_the_scan_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CP 2, bf16, with the index sources' plain top-k on the fused scan (the tiny model's widths
    would take the logits route, `indexer_topk.pick_route`)."""
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_MAX_WIDTH", 0)
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_KEYS_PER_ROW", 0)  # nor by rows
    serial = run_cp(2, _run, False, "bfloat16", False, 1, backend="fake")[0]
    multi = run_cp(2, _run, True, "bfloat16", False, 1, backend="fake")[0]
    _equal(serial[0], multi[0])


@pytest.mark.parametrize("cp", [1, 2])
def test_multistream_with_random_sleeps_50_reps(cp: int) -> None:
    serial = run_cp(cp, _run, False, "bfloat16", False, 1, backend="fake")[0][0]
    multi = run_cp(cp, _run, True, "bfloat16", True, 50, backend="fake")[0]
    for out in multi:
        _equal(serial, out)


def test_memory_after_200_forwards_equals_after_10() -> None:
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41Model(cfg, dtype=torch.bfloat16, device="cuda", seed=5)
    runner = PrefillRunner(model, multistream=True, num_slots=4096, max_context=512)
    prompt = _prompts(cfg.vocab_size)["a"]
    mem = {}
    for i in range(1, 201):
        runner.prefill({"r": prompt})
        runner.release("r")
        if i in (10, 200):
            torch.cuda.synchronize()
            mem[i] = torch.cuda.memory_allocated()
    assert mem[200] == mem[10], mem
