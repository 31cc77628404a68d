"""Architecture rules that must not erode: no torch in the daemon or in `weightwire status`;
protocol is a leaf; the top-level packages import each other without cycles, with the
local-cluster harness below cli and bench; every package folder is shipped; measured
records live in results/, small, outside the packages."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from weightwire.harness.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys, importlib\n"
        "for m in ('weightwire.daemon.main', 'weightwire.daemon.node', 'weightwire.transport.tcp',"
        " 'weightwire.plan.planner', 'weightwire.protocol.local'):\n"
        "    importlib.import_module(m)\n"
        "print(' '.join(sorted(m for m in ('torch', 'numpy', 'sglang') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the daemon side imported: {out.stdout.strip()}"


def test_status_never_imports_torch() -> None:
    """`weightwire status` against a real daemon: the command works and loads no torch."""
    code = (
        "import sys\n"
        "from weightwire.cli.main import main\n"
        "rc = main(['status', '--json', '--socket', sys.argv[1]])\n"
        "print('LOADED', rc, ' '.join(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    with LocalCluster(hosts=1, insecure=True) as c:
        out = subprocess.run(
            [sys.executable, "-c", code, c.daemons[0].socket],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    *shown, last = out.stdout.strip().splitlines()
    assert '"node": "host0"' in "\n".join(shown), out.stdout
    assert last.split()[:2] == ["LOADED", "0"], last
    assert last.split()[2:] == [], f"`weightwire status` imported: {last.split()[2:]}"


def _imports(folder: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_protocol_is_a_leaf() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "__future__"}
    assert _imports("protocol") <= allowed, _imports("protocol") - allowed


def _import_graph() -> ModuleType:
    """scripts/import_graph.py (a script, not a package module), loaded from its file."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


GRAPH = _import_graph()


def test_packages_import_each_other_without_cycles() -> None:
    edges = GRAPH.edges(ROOT)
    packages = GRAPH.package_graph(edges, ROOT)
    assert GRAPH.cycles({p: set(d) for p, d in packages.items()}) == []
    # the local-cluster machinery serves the command line and the benchmarks: it is below both
    assert not set(packages["harness"]) & {"cli", "bench"}, packages["harness"]
    assert "cli" not in packages["bench"], packages["bench"]


def test_modules_import_each_other_without_cycles() -> None:
    """In every package, daemon/ first. A deferred import (inside a function) counts: it
    hides a cycle, it does not remove it."""
    edges = GRAPH.edges(ROOT)
    assert GRAPH.cycles(GRAPH.module_graph(edges, within="weightwire.daemon.")) == []
    assert GRAPH.cycles(GRAPH.module_graph(edges)) == []


def test_no_package_imports_what_the_architecture_forbids() -> None:
    """protocol a leaf; daemon, transport, memory and plan never import client or torch;
    bench and cli meet in harness (cli loads a benchmark only inside its command)."""
    assert GRAPH.violations(GRAPH.edges(ROOT)) == []


def test_the_import_graph_sees_cycles_and_forbidden_imports(tmp_path: Path) -> None:
    """The checks above can fail: a tree with a deferred cycle, a protocol module importing
    numpy and a daemon module importing the client."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "weightwire.daemon" = "d", "weightwire.protocol" = '
        '"p", "weightwire.client" = "c" }\n'
    )
    for folder in "dpc":
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "d/a.py").write_text("from . import b\n")
    (tmp_path / "d/b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "d/c.py").write_text("from weightwire.client import Engine\n")
    (tmp_path / "p/m.py").write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n    import torch\n"
    )
    edges = GRAPH.edges(tmp_path)
    assert GRAPH.cycles(GRAPH.module_graph(edges)) == [
        ["weightwire.daemon.a", "weightwire.daemon.b", "weightwire.daemon.a"]
    ]
    assert [v.split(" ->")[0] for v in GRAPH.violations(edges)] == [
        "weightwire.daemon.c:1",
        "weightwire.protocol.m:2",
    ]


def test_every_package_folder_is_shipped() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = cfg["package-dir"]
    listed = set(cfg["packages"])
    on_disk = set()
    for pkg, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([pkg, *rel.parts]))
    assert on_disk <= listed, f"add to pyproject packages: {sorted(on_disk - listed)}"
    top = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert top <= set(mapped.values()), f"add to package-dir: {sorted(top - set(mapped.values()))}"


def test_records_are_small_and_outside_the_packages() -> None:
    """Records (results/README.md): text and JSON reports as they are, traces and
    line-per-event dumps gzipped, nothing large; none inside a package folder."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in cfg["package-dir"].values():
        inside = [p for p in (ROOT / folder).rglob("*") if p.suffix in (".log", ".jsonl", ".xml")]
        assert not (ROOT / folder / "results").exists() and not inside, f"records in {folder}/"
    records = [p for p in (ROOT / "results").rglob("*") if p.is_file()]
    records = [p for p in records if "out" not in p.relative_to(ROOT / "results").parts[:1]]
    assert records, "results/ is empty"
    for p in records:
        name = p.relative_to(ROOT)
        assert p.stat().st_size <= 256 << 10, f"{name}: over 256 KiB, compress or leave it out"
        assert not p.name.endswith(("trace.json", ".jsonl")), f"{name}: gzip it"
