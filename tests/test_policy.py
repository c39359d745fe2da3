"""MultistreamPolicy: the per-batch decision, per-layer rule, env overrides and logging."""

from __future__ import annotations

import logging

import pytest

from dsv4cp.config import DeepseekV41Config
from dsv4cp.policy import SWA_MAX_TOKENS, MultistreamPolicy


def test_auto_follows_the_measured_thresholds() -> None:
    p = MultistreamPolicy()
    assert not p.decide(2048, graphs=True, cuda=False)  # CPU: never
    assert p.decide(512, graphs=True, cuda=True) and p.decide(8192, graphs=True, cuda=True)
    assert not p.decide(16384, graphs=True, cuda=True)
    assert not p.decide(4096, graphs=False, cuda=True)  # eager: launches cost more
    assert p.decide(8192, graphs=False, cuda=True)


def test_forced_modes_and_bad_mode() -> None:
    assert MultistreamPolicy(mode="on").decide(10**6, graphs=False, cuda=True)
    assert not MultistreamPolicy(mode="off").decide(512, graphs=True, cuda=True)
    with pytest.raises(ValueError, match="auto, on or off"):
        MultistreamPolicy(mode="sometimes")


def test_reuse_layers_stay_serial_and_swa_layers_fork_only_up_to_their_bound() -> None:
    cfg = DeepseekV41Config.tiny()  # swa, r2 source, r2 reuse, r1 source, r1 reuse, consumer
    auto, on = MultistreamPolicy(), MultistreamPolicy(mode="on")
    roles = [cfg.layer_role(i) for i in range(cfg.num_hidden_layers)]
    assert [auto.layer_pays(r, SWA_MAX_TOKENS) for r in roles] == [1, 1, 0, 1, 0, 1]
    assert [auto.layer_pays(r, SWA_MAX_TOKENS + 1) for r in roles] == [0, 1, 0, 1, 0, 1]
    assert all(on.layer_pays(r, 10**6) for r in roles)


def test_env_overrides_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4CP_MULTISTREAM", "off")
    monkeypatch.setenv("DSV4CP_MULTISTREAM_MAX_TOKENS", "1024")
    assert MultistreamPolicy.from_env("auto").mode == "off"
    assert MultistreamPolicy.from_env("on").mode == "on"
    monkeypatch.setenv("DSV4CP_MULTISTREAM", "auto")
    p = MultistreamPolicy.from_env()
    assert p.max_tokens_graph == 1024 and not p.decide(2048, graphs=True, cuda=True)


@pytest.mark.parametrize("value", ["abc", "-5", "1.5"])
def test_bad_env_threshold_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DSV4CP_MULTISTREAM_MAX_TOKENS", value)
    with pytest.raises(ValueError, match=f"DSV4CP_MULTISTREAM_MAX_TOKENS must be .* got '{value}'"):
        MultistreamPolicy.from_env()


@pytest.mark.parametrize("value", ["1", "true", "sometimes"])
def test_bad_env_mode_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DSV4CP_MULTISTREAM", value)
    msg = f"DSV4CP_MULTISTREAM must be one of auto, on, off, got '{value}'"
    with pytest.raises(ValueError, match=msg):
        MultistreamPolicy.from_env()
    assert MultistreamPolicy.from_env("off").mode == "off"  # read only where it applies


def test_decision_logged_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    p = MultistreamPolicy()
    with caplog.at_level(logging.INFO, logger="dsv4cp.policy"):
        for _ in range(3):
            p.decide(512, graphs=True, cuda=True)
        p.decide(1024, graphs=True, cuda=True)
    assert len(caplog.records) == 2
