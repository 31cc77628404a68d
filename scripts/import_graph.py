"""weightwire's import graph, from the source (stdlib `ast`, nothing is imported).

Prints the package-level graph (each top-level package and the others it imports, with how
many module edges make each arrow), every import cycle among modules, and the imports the
architecture forbids (`RULES`). tests/test_boundaries.py asserts the same things.

    python scripts/import_graph.py [--root DIR]    # DIR: a checkout (default: this one)

Every import counts, a deferred one inside a function too (it is still a dependency, only
a later one); imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LEAF_OK = frozenset({"msgspec", "__future__", *sys.stdlib_module_names})


@dataclass(frozen=True)
class Rule:
    """`package` must not import `banned` ("*": anything outside LEAF_OK); with `deferred_ok`
    an import inside a function (run by one command, not at load) is allowed."""

    package: str
    banned: frozenset[str]
    why: str
    deferred_ok: bool = False


# The architecture's one-way arrows.
RULES: tuple[Rule, ...] = (
    Rule("protocol", frozenset({"*"}), "protocol is a leaf (msgspec and the stdlib only)"),
    *(
        Rule(pkg, frozenset({"client", "torch"}), f"{pkg} never imports the client side or torch")
        for pkg in ("daemon", "transport", "memory", "plan")
    ),
    Rule("bench", frozenset({"cli"}), "bench reaches the local-cluster machinery via harness"),
    Rule("harness", frozenset({"cli", "bench"}), "harness is below cli and bench"),
    Rule(
        "cli",
        frozenset({"bench"}),
        "cli loads a benchmark only inside the command that runs it",
        deferred_ok=True,
    ),
)


@dataclass(frozen=True)
class Edge:
    src: str  # module, dotted (weightwire.daemon.node)
    dst: str  # module or outside package (torch), dotted
    line: int
    deferred: bool  # inside a function: imported when it runs, not when the module loads


def packages(root: Path) -> dict[str, Path]:
    """Top-level package name (daemon) -> its folder, as pyproject maps them."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {k.split(".")[1]: root / v for k, v in cfg["package-dir"].items() if "." in k}


def modules(root: Path) -> dict[str, Path]:
    """Every module of weightwire's packages: dotted name -> file."""
    out: dict[str, Path] = {}
    for pkg, folder in packages(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = ["weightwire", pkg, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, deferred: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, deferred
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from (x for n in node.orelse for x in _imports(n, deferred))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(node, True)
        else:
            yield from _imports(node, deferred)


def edges(root: Path) -> list[Edge]:
    """Each import of each module, resolved to the deepest module of ours it names (or the
    outside package's top name)."""
    mods = modules(root)
    out: list[Edge] = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        for node, deferred in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    mod = node.module or ""
                # `from pkg import mod` names a module; `from mod import name` does not
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [mod, *subs]
            for target in targets:
                out.append(Edge(name, _resolve(target, mods), node.lineno, deferred))
    return out


def _resolve(target: str, mods: dict[str, Path]) -> str:
    if not target.startswith("weightwire."):
        return target.split(".")[0]
    parts = target.split(".")
    while len(parts) > 2 and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """weightwire.daemon.node -> daemon; torch -> torch."""
    parts = module.split(".")
    return parts[1] if parts[0] == "weightwire" and len(parts) > 1 else parts[0]


def package_graph(es: list[Edge], root: Path) -> dict[str, dict[str, int]]:
    """Package -> {package of ours it imports: how many module edges}."""
    ours = packages(root)
    graph: dict[str, dict[str, int]] = {p: {} for p in sorted(ours)}
    for e in es:
        a, b = package_of(e.src), package_of(e.dst)
        if a != b and b in ours and a in graph:
            graph[a][b] = graph[a].get(b, 0) + 1
    return graph


def module_graph(es: list[Edge], within: str = "weightwire.") -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (`within`: only those named so). A module's
    import of its own package (`__init__`) is left out: that is loading, not a cycle."""
    graph: dict[str, set[str]] = {}
    for e in es:
        inside = e.src.startswith(within) and e.dst.startswith(within)
        if inside and e.src != e.dst and not e.src.startswith(e.dst + "."):
            graph.setdefault(e.src, set()).add(e.dst)
            graph.setdefault(e.dst, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan), each as one cycle through
    its first node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            group.append(v)
            if len(group) > 1:
                groups.append(_one_cycle(sorted(group), graph))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(groups)


def _one_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the group's first module back to it (breadth first)."""
    start, members = group[0], set(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return group


def violations(es: list[Edge]) -> list[str]:
    """Imports that break `RULES`, one line each (module:line -> target: why)."""
    out = []
    for e in es:
        src, dst = package_of(e.src), package_of(e.dst)
        for rule in RULES:
            if src != rule.package or dst == src or (rule.deferred_ok and e.deferred):
                continue
            if dst in rule.banned or ("*" in rule.banned and dst not in LEAF_OK):
                where = f"{e.src}:{e.line}" + (" (deferred)" if e.deferred else "")
                out.append(f"{where} -> {e.dst}: {rule.why}")
    return out


def report(root: Path) -> str:
    es = edges(root)
    lines = ["package graph (package -> packages it imports, module edges):"]
    pkgs = package_graph(es, root)
    for pkg, deps in pkgs.items():
        shown = ", ".join(f"{d} ({n})" for d, n in sorted(deps.items())) or "-"
        lines.append(f"  {pkg:<10} -> {shown}")
    pkg_cycles = cycles({p: set(d) for p, d in pkgs.items()})
    lines.append(f"package cycles: {len(pkg_cycles)}")
    lines += ["  " + " -> ".join(c) for c in pkg_cycles]
    found = cycles(module_graph(es))
    lines.append(f"module cycles: {len(found)}")
    late = {(e.src, e.dst) for e in es if e.deferred}
    for c in found:
        deferred = any(step in late for step in itertools.pairwise(c))
        shown = " -> ".join(m.removeprefix("weightwire.") for m in c)
        lines.append(f"  {shown}" + ("  (through a deferred import)" if deferred else ""))
    bad = violations(es)
    lines.append(f"forbidden imports: {len(bad)}")
    lines += [f"  {v}" for v in bad]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    args = p.parse_args(argv)
    print(report(args.root.resolve()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
