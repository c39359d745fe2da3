"""Bad input raises a clear exception and leaves the cache exactly as it was."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.cache import CacheFullError
from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner


@pytest.fixture()
def runner() -> PrefillRunner:
    model = DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)
    r = PrefillRunner(model, num_slots=128, max_context=64, max_requests=4, page_size=16)
    r.prefill({"a": list(range(10))})
    return r


def _snapshot(r: PrefillRunner) -> dict:
    tensors = {k: v.clone() for k, v in r.cache.state_dict_view().items()}
    tensors["req_to_token"] = r.cache.req_to_token.clone()
    alloc = (
        sorted(r.alloc.free_pages),
        sorted(r.alloc.free_rows),
        {k: (v.row, v.length, list(v.pages)) for k, v in r.alloc.requests.items()},
    )
    return {"tensors": tensors, "alloc": alloc}


def _unchanged(before: dict, after: dict) -> None:
    assert before["alloc"] == after["alloc"]
    for k, v in before["tensors"].items():
        assert torch.equal(v, after["tensors"][k]), k


CASES = [
    ("empty batch", lambda r: r.prefill({}), ValueError, "empty"),
    ("token out of range", lambda r: r.prefill({"b": [1, 2, 512]}), ValueError, "token id 512"),
    ("negative token", lambda r: r.prefill({"a": [-1]}), ValueError, "token id -1"),
    ("no new tokens", lambda r: r.prefill({"a": []}), ValueError, "no new tokens"),
    (
        "bool start",
        lambda r: r.prefill({"a": [1]}, starts=[False]),
        ValueError,
        r"starts\[0\] must be an int",
    ),
    (
        "float start",
        lambda r: r.prefill({"a": [1]}, starts=[0.0]),
        ValueError,
        r"starts\[0\] must be an int",
    ),
    (
        "positions mismatch",
        lambda r: r.prefill({"a": [1, 2]}, starts=[7]),
        ValueError,
        "start at 7 but the cache holds 10",
    ),
    (
        "prefix longer than the cache holds",
        lambda r: r.prefill({"a": list(range(60))}),
        CacheFullError,
        "max_context",
    ),
    (
        "out of pages",
        lambda r: r.prefill({"b": list(range(60)), "c": list(range(60)), "d": list(range(60))}),
        CacheFullError,
        "pages",
    ),
    (
        "a request twice",
        lambda r: r.prefill([("b", [1, 2]), ("b", [3])]),
        ValueError,
        "'b' appears twice",
    ),
    (
        "one bad request poisons the batch",
        lambda r: r.prefill({"b": [1, 2], "c": [999]}),
        ValueError,
        "token id 999",
    ),
    # Reliability probe D12: token ids are never coerced (int(1.7) == 1, int("5") == 5).
    ("float token ids", lambda r: r.prefill({"b": [1.7, 2.2]}), ValueError, "1.7 of type float"),
    ("string token ids", lambda r: r.prefill({"b": ["5", "6"]}), ValueError, "'5' of type str"),
    ("a string as the ids", lambda r: r.prefill({"b": "56"}), ValueError, "sequence of ints"),
    ("bool token id", lambda r: r.prefill({"b": [True]}), ValueError, "True of type bool"),
    (
        "float tensor token id",
        lambda r: r.prefill({"b": [torch.tensor(1.0)]}),
        ValueError,
        "tensor torch.float32",
    ),
    # Malformed requests: a ValueError naming the request, not an unpacking or hashing error.
    (
        "a list of prompts without rids",
        lambda r: r.prefill([[1, 2, 3]]),
        ValueError,
        r"request 0 is \[1, 2, 3\]: .*\(rid, token ids\) pair",
    ),
    ("an int as the ids", lambda r: r.prefill({"b": 5}), ValueError, "'b'.*sequence of ints"),
    ("None as the ids", lambda r: r.prefill([("b", None)]), ValueError, "sequence of ints"),
    ("a set as the ids", lambda r: r.prefill({"b": {1, 2}}), ValueError, "sequence of ints"),
    (
        "a 0-d tensor as the ids",
        lambda r: r.prefill({"b": torch.tensor(3)}),
        ValueError,
        "sequence of ints",
    ),
    (
        "an unhashable rid",
        lambda r: r.prefill([("b", [1]), (["x"], [1, 2])]),
        ValueError,
        r"request 1 has rid \['x'\].*not hashable",
    ),
    ("a string as the requests", lambda r: r.prefill("ab"), ValueError, "mapping rid"),
    ("an int as the requests", lambda r: r.prefill(3), ValueError, "mapping rid"),
    # generate(..., 0) runs nothing but checks its prompts as a prefill would.
    ("generate 0 of an empty prompt", lambda r: r.generate([[]], 0), ValueError, "no new tokens"),
    (
        "generate 0 of a prompt over max_context",
        lambda r: r.generate([[1, 2], list(range(65))], 0),
        CacheFullError,
        "65 tokens exceed max_context=64",
    ),
]


def test_integer_token_ids_of_any_int_type(runner: PrefillRunner) -> None:
    import numpy as np

    a = runner.prefill({"x": [3, 4, 5]}).logits
    b = runner.prefill({"y": [np.int64(3), torch.tensor(4), np.int32(5)]}).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("name,call,exc,msg", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_keeps_cache(runner: PrefillRunner, name, call, exc, msg) -> None:
    before = _snapshot(runner)
    with pytest.raises(exc, match=msg):
        call(runner)
    _unchanged(before, _snapshot(runner))


def test_failure_inside_the_forward_rolls_back(runner: PrefillRunner, monkeypatch) -> None:
    before = _snapshot(runner)

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(runner.model, "forward_hidden", boom)
    with pytest.raises(RuntimeError, match="injected"):
        runner.prefill({"b": [1, 2, 3]})
    _unchanged(before, _snapshot(runner))
    monkeypatch.undo()
    runner.prefill({"b": [1, 2, 3]})  # and the runner still works
