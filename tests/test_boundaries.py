"""Architecture rules that must not erode: no torch in the daemon or in `weightwire status`;
protocol is a leaf; the top-level packages import each other without cycles, with the
local-cluster harness below cli and bench; every package folder is shipped; measured
records live in results/, small, outside the packages."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

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


def _package_edges() -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages it imports (`weightwire.X`)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {k.split(".")[1]: v for k, v in cfg["package-dir"].items() if "." in k}
    edges: dict[str, set[str]] = {pkg: set() for pkg in folders}
    for pkg, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "weightwire" and len(parts) > 1 and parts[1] in folders:
                        edges[pkg].add(parts[1])
        edges[pkg].discard(pkg)
    return edges


def test_packages_import_each_other_without_cycles() -> None:
    edges = _package_edges()
    done: set[str] = set()

    def visit(pkg: str, path: list[str]) -> None:
        if pkg in path:
            cycle = " -> ".join([*path[path.index(pkg) :], pkg])
            raise AssertionError(f"import cycle between packages: {cycle}")
        if pkg in done:
            return
        for dep in sorted(edges[pkg]):
            visit(dep, [*path, pkg])
        done.add(pkg)

    for pkg in sorted(edges):
        visit(pkg, [])
    # the local-cluster machinery serves the command line and the benchmarks: it is below both
    assert not edges["harness"] & {"cli", "bench"}, edges["harness"]
    assert "cli" not in edges["bench"], edges["bench"]


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
