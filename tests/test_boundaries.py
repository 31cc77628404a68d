"""Architecture rules that must not erode: no torch in the daemon; protocol is a leaf;
every package folder is shipped."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

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
