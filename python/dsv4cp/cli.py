"""`dsv4cp` command line: demo, check, profile, export-tiny, accuracy, cache-size,
reference-check.

Each subcommand lives in `dsv4cp/commands/<name>_cmd.py` with `add_parser(subparsers)` and
`run(args) -> int`; this file only dispatches.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NoReturn

COMMANDS = {
    "demo": "dsv4cp.commands.demo_cmd",
    "check": "dsv4cp.commands.check_cmd",
    "profile": "dsv4cp.commands.profile_cmd",
    "export-tiny": "dsv4cp.commands.export_tiny_cmd",
    "accuracy": "dsv4cp.commands.accuracy_cmd",
    "cache-size": "dsv4cp.commands.cache_size_cmd",
    "reference-check": "dsv4cp.commands.reference_check_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4cp",
        description="DeepSeek-V4.1 prefill under context parallelism (CP), multistream side "
        "streams and breakable CUDA graphs (BCG).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
        # `<command> --help` opens with the one-line summary `dsv4cp --help` lists, and every
        # flag with a help text shows its default
        summary = next((a.help for a in sub._choices_actions if a.dest == p.prog.split()[-1]), None)
        p.description = p.description or summary
        p.formatter_class = _DefaultsShown
    return parser


class _DefaultsShown(argparse.HelpFormatter):
    """A flag's default after its help, unless the help already says it or there is none to
    show (a required flag, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not text
            or "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default {shown})".replace("%", "%%")


def _reported(e: Exception, command: str) -> int | None:
    """The exit status for an error shown as its message alone (no traceback), else None.

    Input errors (`UsageError`, a checkpoint that cannot be read or does not fit the model
    (`CheckpointError`), side streams that cannot be had) exit 2; a CP run that failed
    (a rank died, hung or raised; a collective failed) exits 1 with the launcher's summary (the
    ranks' tracebacks too with DSV4CP_DEBUG_CP=1)."""
    from dsv4cp.checkpoint.errors import CheckpointError
    from dsv4cp.commands.common import UsageError
    from dsv4cp.cp.group import CPCommError
    from dsv4cp.cp.guard import debug_cp_enabled
    from dsv4cp.cp.launch import CPLaunchError
    from dsv4cp.side_streams import SideStreamError

    if isinstance(e, (UsageError, CheckpointError, SideStreamError)):
        print(f"dsv4cp {command}: {e}", file=sys.stderr)
        return 2
    if isinstance(e, CPLaunchError):
        text = str(e) if debug_cp_enabled() else e.summary()
        print(f"dsv4cp {command}: {text}", file=sys.stderr)
        return 1
    if isinstance(e, CPCommError):
        print(f"dsv4cp {command}: {e}", file=sys.stderr)
        return 1
    return None


def _check_environment(command: str) -> int | None:
    """Every set DSV4CP_* variable parsed before any work: a bad value is one line and exit 2
    (not an error in the middle of a forward); an unknown DSV4CP_* name is a warning."""
    from dsv4cp.routing import check_environment

    try:
        warnings = check_environment()
    except ValueError as e:
        print(f"dsv4cp {command}: {e}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"dsv4cp {command}: warning: {line}", file=sys.stderr)
    return None


class Terminated(BaseException):
    """SIGTERM arrived while a subcommand ran (raised by `_terminate_as_exception`'s handler)."""


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread while the subcommand runs, so its
    `finally` blocks run as for Ctrl-C: CP ranks are stopped, export-tiny removes its scratch
    directory (SIGTERM's default action ended the process at once and left it). Only where
    SIGTERM has its default action, in the main thread; the old action is restored after."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit status. Input errors print one line and return 2;
    Ctrl-C prints `interrupted` and returns 130, SIGTERM `terminated` and 143."""
    args = build_parser().parse_args(argv)
    status = _check_environment(args.command)
    if status is not None:
        return status
    from dsv4cp.cp.guard import ENV_VAR as DEBUG_CP_ENV

    debug_cp = getattr(args, "debug_cp", False)
    saved = os.environ.get(DEBUG_CP_ENV)
    if debug_cp:  # what DSV4CP_DEBUG_CP=1 does; the spawned ranks inherit it
        os.environ[DEBUG_CP_ENV] = "1"
    try:
        with _terminate_as_exception():
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except Exception as e:
        status = _reported(e, args.command)
        if status is None:
            raise
        return status
    finally:
        if debug_cp:  # an in-process caller (tests) keeps its own environment
            if saved is None:
                os.environ.pop(DEBUG_CP_ENV, None)
            else:
                os.environ[DEBUG_CP_ENV] = saved


def _clean_exit() -> bool:
    from dsv4cp import env_vars

    return bool(env_vars.read("DSV4CP_CLEAN_EXIT"))


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The `dsv4cp` entry point: `main`, then exit. After CUDA work the process leaves with
    `os._exit` once the device is idle and the output flushed: on the H200, interpreter teardown
    after fake-CP ranks captured CUDA graphs on side streams segfaulted (exit -11) after a
    passing run (docs/reliability.md, "Exit after CUDA work"). DSV4CP_CLEAN_EXIT=1 keeps the
    normal teardown."""
    code = main(argv)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and not _clean_exit():
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
