"""The README's settings table and the example TOML are what daemon/configdoc.py makes from
DaemonConfig, every setting is documented, and every flag's help is its documentation."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from weightwire.daemon import configdoc
from weightwire.daemon.config import DaemonConfig, load
from weightwire.daemon.main import parser

ROOT = Path(__file__).resolve().parent.parent
FIX = "run `python -m weightwire.daemon.configdoc --write` and commit the result"


def test_every_setting_is_documented() -> None:
    docs = configdoc.settings()
    assert [s.name for s in docs] == [f.name for f in msgspec.structs.fields(DaemonConfig)]
    assert all(len(s.doc) > 10 for s in docs), [s.name for s in docs if len(s.doc) <= 10]


def test_readme_table_is_generated() -> None:
    readme = (ROOT / "README.md").read_text()
    assert configdoc.readme_with_table(readme) == readme, FIX


def test_example_toml_is_generated_and_names_only_real_settings() -> None:
    text = (ROOT / "systemd" / "weightwired.toml").read_text()
    assert text == configdoc.example_toml(), FIX
    # every setting appears (set or commented out), and nothing that is not one
    names = {f.name for f in msgspec.structs.fields(DaemonConfig)}
    shown = {
        line.lstrip("# ").split(" = ")[0]
        for line in text.splitlines()
        if " = " in line and not line.startswith("# ==")
    }
    assert shown == names, (shown - names, names - shown)
    assert "coordinator_public_key" in shown and "curve_public_key_file" not in text
    cfg = load(str(ROOT / "systemd" / "weightwired.toml"), {})
    assert set(tomllib.loads(text)) <= names and cfg.coordinator.startswith("tcp://")
    # the commented-out lines are valid too: uncommented, the file still loads
    full = "\n".join(
        line[2:]
        if line.startswith("# ") and " = " in line and not line.startswith("# ==")
        else line
        for line in text.splitlines()
        if "<" not in line  # placeholders such as "<z85 public key>"
    )
    msgspec.convert(tomllib.loads(full), DaemonConfig)


def test_flag_help_is_the_setting_doc() -> None:
    helps = {a.dest: a.help for a in parser()._actions if a.option_strings}
    for s in configdoc.settings():
        assert helps[s.name] and s.doc.replace("%", "%%") in helps[s.name], s.name
    # argparse renders every help string (a stray % would break --help)
    assert "verbs_chunk_bytes" in parser().format_help()
