"""Kernel checks under Triton's CPU interpreter, run in a child process.

TRITON_INTERPRET must be set before triton is imported, so a test file runs its cases as
`python <test file> <case> ...` (`run_interpreter_cases`, in the parent) and, as `__main__`,
reports each case's outcome as one JSON line (`report_cases`, in the child).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_cases(
    test_file: str, cases: Sequence[str], *, timeout: float = 900
) -> dict[str, str]:
    """{case: "ok" or its traceback}; an AssertionError with the child's stderr if it died."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT)])
    env.pop("DSV4CP_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, test_file, *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"interpreter child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def report_cases(cases: Mapping[str, Callable[[], object]], names: Sequence[str]) -> None:
    """Run the named cases; print {name: "ok" or the traceback} as one JSON line (every case
    reported, not only the first failure)."""
    results = {}
    for name in names:
        try:
            cases[name]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent
            results[name] = traceback.format_exc()
    print(json.dumps(results))
