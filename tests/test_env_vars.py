"""The DSV4CP_* table (`env_vars`): each variable's values, its refusals naming it, the typo
warnings, the start-up checks of the CLI and the SGLang plugin, and the docs' tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4cp import env_vars
from dsv4cp.env_vars import ENV_VARS, EnvVarError, check_environment, read, unknown_names
from dsv4cp.layers.linear import KeptWeights
from dsv4cp.routing import ROUTES

ROOT = Path(__file__).resolve().parents[1]

# name → (values it takes and what they parse to, values it refuses)
CASES: dict[str, tuple[dict[str, object], list[str]]] = {
    "DSV4CP_CHECK_FINITE": ({"1": True, "0": False, " Yes ": True, "off": False}, ["2", "y"]),
    "DSV4CP_CHECK_WINDOW": ({"1": True, "false": False}, ["2", "auto"]),
    "DSV4CP_KERNELS": ({"torch": "torch", " Triton ": "triton"}, ["cuda", "off"]),
    "DSV4CP_KERNELS_OFF": (
        {"fp8_linear, swa_key": frozenset({"fp8_linear", "swa_key"}), ",": frozenset()},
        ["fp8-linear", "a b"],
    ),
    "DSV4CP_CLEAN_EXIT": ({"1": True, "0": False}, ["-1"]),
    "DSV4CP_DEBUG_CP": ({"1": True, "on": True, "no": False}, ["2", "debug"]),
    "DSV4CP_MAX_CP_RANKS": ({"1": 1, " 96 ": 96}, ["0", "-3", "4.5", "many"]),
    "DSV4CP_SIDE_STREAMS": ({"pool": "pool", "External": "external"}, ["dedicated"]),
    "DSV4CP_FP8_GEMM": ({"cublas": "cublas", "TRITON": "triton"}, ["cutlass", "fused"]),
    "DSV4CP_FLASHMLA": ({"off": "off", "0": "0", "auto": "auto", "on": "on"}, ["of", "legacy"]),
    "DSV4CP_GLUON_ATTENTION": (
        {"on": "on", " OFF ": "off", "1": "1", "Auto": "auto"},
        ["gluon", "2"],
    ),
    "DSV4CP_FLASHMLA_WORKSPACE_MIB": (
        {"1100": 1100.0, "0.5": 0.5},
        ["abc", "0", "-5", "nan", "inf", "1e999"],
    ),
    "DSV4CP_KEEP_BF16_WEIGHTS": ({"attention": "attention", "ALL": "all"}, ["yes", "bf16"]),
    "DSV4CP_MULTISTREAM": ({"on": "on", "OFF": "off", "auto": "auto"}, ["1", "true"]),
    "DSV4CP_MULTISTREAM_MAX_TOKENS": ({"0": 0, "4096": 4096}, ["-1", "4k"]),
    "DSV4CP_NVTX": ({"0": False, "1": True}, ["none"]),
}


def test_every_variable_has_cases() -> None:
    assert set(CASES) == set(ENV_VARS)


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_values_parse_and_bad_values_name_the_variable(name: str) -> None:
    good, bad = CASES[name]
    assert read(name, {}) == ENV_VARS[name].default
    assert read(name, {name: "  "}) == ENV_VARS[name].default
    for raw, value in good.items():
        assert read(name, {name: raw}) == value, raw
    for raw in bad:
        with pytest.raises(EnvVarError, match=rf"^{name} .*, got {re.escape(repr(raw))}$"):
            read(name, {name: raw})


def test_read_follows_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4CP_FP8_GEMM", "cublas")
    assert read("DSV4CP_FP8_GEMM") == "cublas"
    monkeypatch.setenv("DSV4CP_FP8_GEMM", "triton")
    assert read("DSV4CP_FP8_GEMM") == "triton"
    monkeypatch.setenv("DSV4CP_FP8_GEMM", "nope")
    for _ in range(2):  # a refused value is refused on every read, not cached as a value
        with pytest.raises(EnvVarError, match="DSV4CP_FP8_GEMM"):
            read("DSV4CP_FP8_GEMM")
    with pytest.raises(KeyError, match="DSV4CP_NOT_A_VARIABLE"):
        read("DSV4CP_NOT_A_VARIABLE")


def test_kept_weights_choices_match_the_loader() -> None:
    from typing import get_args

    for scope in get_args(KeptWeights):
        assert read("DSV4CP_KEEP_BF16_WEIGHTS", {"DSV4CP_KEEP_BF16_WEIGHTS": scope}) == scope


def test_unknown_names_suggest_the_closest_and_say_what_retired() -> None:
    env = {
        "DSV4CP_KEEP_BF16_WEIGHT": "all",
        "DSV4CP_SGLANG_CP": "4",
        "DSV4CP_ZZZ": "1",
        "DSV4CP_NVTX": "0",
        "PATH": "/bin",
    }
    lines = unknown_names(env)
    assert lines == [
        "DSV4CP_KEEP_BF16_WEIGHT is not a dsv4cp variable and changes nothing "
        "(did you mean DSV4CP_KEEP_BF16_WEIGHTS?)",
        f"DSV4CP_SGLANG_CP is not read: {env_vars.RETIRED['DSV4CP_SGLANG_CP']}",
        "DSV4CP_ZZZ is not a dsv4cp variable and changes nothing",
    ]
    assert check_environment({"DSV4CP_NVTX": "0"}) == []
    with pytest.raises(EnvVarError, match="DSV4CP_NVTX"):
        check_environment({"DSV4CP_NVTX": "maybe", "DSV4CP_ZZZ": "1"})


def test_every_dsv4cp_name_in_the_package_is_in_the_table() -> None:
    """A module reading a DSV4CP_* variable of its own would bypass the start-up check."""
    names = set()
    for path in (ROOT / "python" / "dsv4cp").rglob("*.py"):
        names |= set(re.findall(r"DSV4CP_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert names <= set(ENV_VARS) | set(env_vars.RETIRED)


def _doc_names(doc: str, heading: str) -> set[str]:
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index(heading) :]
    table = (section + "\n\n")[: (section + "\n\n").index("\n\n", section.index("| variable"))]
    return set(re.findall(r"`(DSV4CP_[A-Z0-9_]+)", table))


def test_the_docs_list_every_variable() -> None:
    assert _doc_names("reliability.md", "## Environment variables") == set(ENV_VARS)
    assert _doc_names("sglang.md", "## Environment variables") <= set(ENV_VARS)


def test_routes_off_names_are_checked_against_the_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4cp.routing import routes_off

    name = sorted(ROUTES)[0]
    monkeypatch.setenv("DSV4CP_KERNELS_OFF", f"{name},no_such_route")
    with pytest.raises(EnvVarError, match=r"unknown routes \['no_such_route'\]"):
        routes_off()


def _cli(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(env_vars.PREFIX)}
    env.update(env_extra)
    argv = [sys.executable, "-m", "dsv4cp", "cache-size", "--config", "tiny", "--tokens", "64"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_cli_refuses_a_bad_value_before_any_work() -> None:
    for extra, said in [
        ({"DSV4CP_FP8_GEMM": "fused"}, "DSV4CP_FP8_GEMM must be one of auto, triton, cublas, glu"),
        ({"DSV4CP_KERNELS_OFF": "no_such_route"}, "unknown routes ['no_such_route']"),
        ({"DSV4CP_FLASHMLA_WORKSPACE_MIB": "1 GiB"}, "DSV4CP_FLASHMLA_WORKSPACE_MIB must be"),
    ]:
        proc = _cli(extra)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dsv4cp cache-size: "), proc.stderr
        assert said in lines[0]


def test_cli_warns_about_an_unknown_name_and_runs() -> None:
    proc = _cli({"DSV4CP_MULTISTREAMS": "on"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        "dsv4cp cache-size: warning: DSV4CP_MULTISTREAMS is not a dsv4cp variable and changes "
        "nothing (did you mean DSV4CP_MULTISTREAM?)"
    )
    assert proc.stdout  # the command's own output
