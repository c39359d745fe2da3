"""The package's import graph: no cycle, and every edge allowed by the table in
docs/architecture.md ("Who may import whom"), which this test reads.

Every `import` / `from ... import` of a `dsv4cp` module counts, wherever it stands: at module
level, inside a function (lazy imports), or under `if TYPE_CHECKING:`. `from dsv4cp.x import y`
is an edge to `dsv4cp.x.y` when that is a module, else to `dsv4cp.x`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "dsv4cp"
DOC = ROOT / "docs" / "architecture.md"
ONLY_IN = {"sglang": "integrations", "triton": "kernels"}  # third-party package → its one room


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(dsv4cp modules, top-level third-party packages) imported anywhere in the file."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        for name in names:
            if name == "dsv4cp" or name.startswith("dsv4cp."):
                while name not in modules:  # `import dsv4cp.cp.group as g` etc.
                    name = name.rpartition(".")[0]
                ours.add(name)
            else:
                theirs.add(name.split(".")[0])
    return ours, theirs


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    edges, external = {}, {}
    for name, path in modules.items():
        ours, theirs = _imports(path, modules)
        edges[name], external[name] = ours - {name}, theirs
    return edges, external


def _rooms() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(room → member prefixes, room → allowed names) from the doc's table."""
    text = DOC.read_text()
    table = text.split("<!-- layering: rooms -->", 1)[1].split("<!-- /layering -->", 1)[0]
    members, allowed = {}, {}
    for line in table.strip().splitlines()[2:]:
        room_cell, member_cell, allow_cell = (c.strip() for c in line.strip("|").split("|"))
        room = room_cell.strip("`")
        members[room] = re.findall(r"`([\w.]+)`", member_cell)
        allowed[room] = re.findall(r"`([\w.]+)`", allow_cell.split("(")[0])
    return members, allowed


def _in(module: str, prefix: str) -> bool:
    full = "dsv4cp" if prefix == "dsv4cp" else f"dsv4cp.{prefix}"
    return module == full or module.startswith(full + ".") and prefix != "dsv4cp"


def _room_of(module: str, members: dict[str, list[str]]) -> str | None:
    best = None  # the most specific prefix wins (`dsv4cp` itself only matches the root)
    for room, prefixes in members.items():
        for p in prefixes:
            if _in(module, p) and (best is None or len(p) > len(best[1])):
                best = (room, p)
    return best[0] if best else None


def _allows(module: str, target: str, members: dict, allowed: dict) -> bool:
    src, dst = _room_of(module, members), _room_of(target, members)
    if src == dst:
        return True
    for name in allowed[src]:
        if name in members and dst == name:
            return True
        if name not in members and _in(target, name):
            return True
    return False


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    colour: dict[str, int] = {}
    for start in sorted(edges):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
    return None


def test_no_import_cycle() -> None:
    edges, _ = _graph()
    assert len(edges) > 40
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_every_module_has_a_room() -> None:
    members, _ = _rooms()
    homeless = [m for m in _modules() if _room_of(m, members) is None]
    assert not homeless, f"add these modules to a room in docs/architecture.md: {homeless}"


def test_every_edge_is_allowed_by_the_table() -> None:
    members, allowed = _rooms()
    edges, _ = _graph()
    bad = sorted(
        f"{m} -> {t}" for m, ts in edges.items() for t in ts if not _allows(m, t, members, allowed)
    )
    assert not bad, "imports that docs/architecture.md does not allow:\n" + "\n".join(bad)


def test_third_party_packages_stay_in_their_room() -> None:
    members, _ = _rooms()
    _, external = _graph()
    bad = sorted(
        f"{m} imports {pkg}"
        for m, pkgs in external.items()
        for pkg, room in ONLY_IN.items()
        if pkg in pkgs and _room_of(m, members) != room
    )
    assert not bad, bad


def test_the_checks_can_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    members, allowed = _rooms()
    assert not _allows("dsv4cp.ops.rope", "dsv4cp.kernels.topk", members, allowed)
    assert not _allows("dsv4cp.cp.group", "dsv4cp.model", members, allowed)
    assert not _allows("dsv4cp.layers.attention", "dsv4cp.graphs.bcg", members, allowed)
    assert not _allows("dsv4cp.layers.attention", "dsv4cp.observe.profiling", members, allowed)
    assert not _allows("dsv4cp.schedule", "dsv4cp.observe.timing", members, allowed)
    assert not _allows("dsv4cp.runner", "dsv4cp.tools.checking", members, allowed)
    assert _allows("dsv4cp.layers.attention", "dsv4cp.observe.timing", members, allowed)
    assert _room_of("dsv4cp", members) == "package"
    assert _room_of("dsv4cp.cli", members) == "commands"
