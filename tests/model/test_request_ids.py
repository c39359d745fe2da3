"""Runner request ids (issue 16, item 5): generate() never continues a stale request, decode() of
an id that is not live is an error, max_new_tokens 0 / negative are defined."""

from __future__ import annotations

import pytest

from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)


def _runner(model: DeepseekV41Model) -> PrefillRunner:
    return PrefillRunner(model, num_slots=512, max_context=128)


def test_generate_twice_gives_the_same_tokens_and_releases(model: DeepseekV41Model) -> None:
    r = _runner(model)
    first = r.generate([PROMPT, PROMPT[:3]], 4)
    assert r.alloc.requests == {}
    assert r.generate([PROMPT, PROMPT[:3]], 4) == first
    assert _runner(model).generate([PROMPT], 4) == first[:1]


def test_generate_skips_and_refuses_live_ids(model: DeepseekV41Model) -> None:
    r = _runner(model)
    r.prefill({"gen0": [9, 9, 9]})
    assert r.generate([PROMPT], 3) == _runner(model).generate([PROMPT], 3)
    assert r.alloc.requests["gen0"].length == 3  # the caller's request is untouched
    with pytest.raises(ValueError, match="request 'gen0' is live"):
        r.generate([PROMPT], 3, rids=["gen0"])
    with pytest.raises(ValueError, match="2 rids for 1 prompts"):
        r.generate([PROMPT], 3, rids=["x", "y"])
    with pytest.raises(ValueError, match=r"rid 0 \(\['x'\]\) is not hashable"):
        r.generate([PROMPT], 3, rids=[["x"]])
    assert set(r.alloc.requests) == {"gen0"}


def test_generate_releases_on_error(model: DeepseekV41Model) -> None:
    r = _runner(model)
    with pytest.raises(ValueError, match="token id 512"):
        r.generate([PROMPT, [1, 512]], 3, rids=["a", "b"])
    assert r.alloc.requests == {}


def test_generate_zero_and_negative_new_tokens(model: DeepseekV41Model) -> None:
    r = _runner(model)
    assert r.generate([PROMPT, [1]], 0) == [[], []]
    assert r.alloc.requests == {}
    with pytest.raises(ValueError, match="token id -3"):
        r.generate([[-3]], 0)  # the prompts are still checked
    for bad in (-5, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            r.generate([PROMPT], bad)  # type: ignore[arg-type]


def test_decode_of_an_unknown_or_released_id_is_an_error(model: DeepseekV41Model) -> None:
    r = _runner(model)
    with pytest.raises(ValueError, match="decode: request 'ghost' is not live"):
        r.decode({"ghost": 5})
    assert r.alloc.requests == {}
    r.prefill({"a": PROMPT})
    r.decode({"a": 8})
    assert r.alloc.requests["a"].length == len(PROMPT) + 1
    r.release("a")
    with pytest.raises(ValueError, match="request 'a' is not live"):
        r.decode({"a": 9})
