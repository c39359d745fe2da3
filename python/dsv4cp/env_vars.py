"""Every `DSV4CP_*` environment variable: its name, its values and what it does, in one table.

The modules that act on a variable read it through `read` (at the moment they act, so a test
or a caller may change it between calls). `check_environment` parses every variable that is
set, up front: the CLI (before any work) and the SGLang plugin (at server start) call it, so a
bad value is one clear error at start-up, not an exception in the first forward of a served
model. A `DSV4CP_*` name that is not in the table is most likely a typo: it is reported with
the closest known name, as a warning (it changes nothing).

Imports nothing from dsv4cp: every room may read the table.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENV_VARS",
    "PREFIX",
    "RETIRED",
    "EnvVar",
    "EnvVarError",
    "check_environment",
    "read",
    "unknown_names",
]

PREFIX = "DSV4CP_"


class EnvVarError(ValueError):
    """A `DSV4CP_*` variable holds a value its parser refuses; the message names it."""


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return value

    return parse


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("must be 1 or 0 (also true/false, yes/no, on/off)")


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"must be an integer >= {low}") from None
        if value < low:
            raise ValueError(f"must be an integer >= {low}")
        return value

    return parse


def _positive_mib(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("must be a number of MiB > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError("must be a finite number of MiB > 0")
    return value


def _names(raw: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    bad = sorted(n for n in names if not n.isidentifier())
    if bad:
        raise ValueError(f"must be a comma-separated list of route names, got {bad}")
    return names


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse` turns its text into a value or raises ValueError saying what the
    value must be; `default` is the value when it is unset or empty (None: decided by the
    reader, e.g. by device)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    effect: str


_TABLE = (
    EnvVar(
        "DSV4CP_CHECK_FINITE",
        _flag,
        False,
        "check every layer's output for NaN/inf (a host sync per layer); read when a model "
        "is built",
    ),
    EnvVar(
        "DSV4CP_CHECK_WINDOW",
        _flag,
        None,
        "SGLang-served: check that every SWA row a forward's windows read is held "
        "(unset: on for CPU, off for CUDA)",
    ),
    EnvVar(
        "DSV4CP_KERNELS",
        _choice("triton", "torch"),
        "triton",
        "torch: every routed op on its pure-torch twin on CUDA",
    ),
    EnvVar(
        "DSV4CP_KERNELS_OFF",
        _names,
        frozenset(),
        "a comma list of routes (routing.ROUTES) sent to their torch twins on CUDA",
    ),
    EnvVar(
        "DSV4CP_CLEAN_EXIT",
        _flag,
        False,
        "the CLI exits through Python's teardown after CUDA work, not os._exit",
    ),
    EnvVar(
        "DSV4CP_DEBUG_CP",
        _flag,
        False,
        "the collective-order guard everywhere; the CLI prints the ranks' tracebacks of a "
        "failed CP run",
    ),
    EnvVar(
        "DSV4CP_MAX_CP_RANKS",
        _int_at_least(1),
        None,
        "the largest gloo / fake CP size (unset: 4 per CPU core / 64)",
    ),
    EnvVar(
        "DSV4CP_SIDE_STREAMS",
        _choice("auto", "external", "pool"),
        "auto",
        "how side streams are made (auto: the CUDA runtime, the driver, then torch's pool)",
    ),
    EnvVar(
        "DSV4CP_FP8_GEMM",
        _choice("auto", "triton", "cublas", "gluon"),
        "auto",
        "the fp8 GEMMs: auto takes cuBLAS over the dequantized weight from 512 rows with bf16 "
        "in and out, else the Triton kernel; triton / cublas force one at every size; gluon "
        "takes the Gluon kernel on the fp8 weight (Hopper) where auto takes cuBLAS without a "
        "kept bf16 weight",
    ),
    EnvVar(
        "DSV4CP_FLASHMLA",
        _choice("auto", "on", "off", "1", "0", "true", "false", "yes", "no"),
        "auto",
        "off (or 0/false/no): sparse attention keeps the Triton kernels where FlashMLA would "
        "run; auto/on: FlashMLA where installed and the shape fits",
    ),
    EnvVar(
        "DSV4CP_GLUON_ATTENTION",
        _choice("auto", "on", "off", "1", "0", "true", "false", "yes", "no"),
        "auto",
        "where FlashMLA does not run, the half-buffer Gluon sm_90 sparse attention over "
        "FlashMLA's bf16 workspace (Hopper, 64 heads x 512, bf16) instead of the Triton "
        "kernel: auto where FlashMLA is not installed or does not fit, but not under "
        "DSV4CP_FLASHMLA=off; "
        "on (1/true/yes) there too; off (0/false/no) never",
    ),
    EnvVar(
        "DSV4CP_FLASHMLA_WORKSPACE_MIB",
        _positive_mib,
        None,
        "the FlashMLA workspace budget per call in MiB (unset: 1024)",
    ),
    EnvVar(
        "DSV4CP_KEEP_BF16_WEIGHTS",
        _choice("off", "attention", "all"),
        "off",
        "the checkpoint loader holds bf16 copies of fp8 weights (attention projections, or "
        "every fp8 linear) so large GEMMs skip the per-call dequantization",
    ),
    EnvVar(
        "DSV4CP_MULTISTREAM",
        _choice("auto", "on", "off"),
        None,
        "the multistream policy when the runner's mode is auto",
    ),
    EnvVar(
        "DSV4CP_MULTISTREAM_MAX_TOKENS",
        _int_at_least(0),
        None,
        "the multistream policy's largest local token count under graphs",
    ),
    EnvVar("DSV4CP_NVTX", _flag, True, "0: no NVTX ranges from `stage` on CUDA"),
)

ENV_VARS: Mapping[str, EnvVar] = {v.name: v for v in _TABLE}

# Names that used to mean something: what to do instead.
RETIRED: Mapping[str, str] = {
    "DSV4CP_SGLANG_CP": "gone: SGLang's own CP flags drive dsv4cp's CP (docs/sglang.md)",
}


# Routed ops read their variables on every call: each (name, text) is parsed once (the values
# are immutable; a bad one raises on every call, since lru_cache keeps no exceptions).
@functools.lru_cache(maxsize=256)
def _parse(name: str, raw: str) -> Any:
    var = ENV_VARS[name]
    if not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise EnvVarError(f"{name} {e}, got {raw!r}") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of `name` (its default when unset or blank); EnvVarError names a bad
    value. KeyError for a name the table does not have."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not in dsv4cp.env_vars.ENV_VARS")
    return _parse(name, (os.environ if environ is None else environ).get(name, ""))


def unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per set `DSV4CP_*` name the table does not have, with the closest known name."""
    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in ENV_VARS):
        if name in RETIRED:
            lines.append(f"{name} is not read: {RETIRED[name]}")
            continue
        close = difflib.get_close_matches(name, list(ENV_VARS), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a dsv4cp variable and changes nothing{hint}")
    return lines


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every set variable of the table (EnvVarError on the first bad value, in the
    table's order); the warnings for names it does not have."""
    for name in ENV_VARS:
        read(name, environ)
    return unknown_names(environ)
