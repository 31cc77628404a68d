"""Command-line conventions: `--version` on both commands (never a prefix of another
flag), every flag documented, `keygen` never silently replaces a key pair."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import weightwire
from weightwire.cli.main import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("module", "prog"), [("weightwire.daemon", "weightwired"), ("weightwire.cli", "weightwire")]
)
def test_version_on_both_commands(module: str, prog: str) -> None:
    r = run(module, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{prog} {weightwire.__version__}"


def test_no_flag_is_read_from_a_prefix() -> None:
    """`--version-t 5` used to be taken for --version-timeout-s; now it is an error."""
    r = run("weightwire.daemon", "--version-t", "5", "--insecure", "--is-coordinator")
    assert r.returncode == 2 and "unrecognized arguments: --version-t" in r.stderr
    r = run("weightwire.cli", "status", "--js")
    assert r.returncode == 2 and "unrecognized arguments: --js" in r.stderr


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [p]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _parsers(sub)
    return out


def test_every_flag_has_help() -> None:
    from weightwire.cli.main import build_parser
    from weightwire.daemon.main import parser as daemon_parser

    undocumented = [
        f"{p.prog} {'/'.join(a.option_strings)}"
        for p in [daemon_parser(), *_parsers(build_parser())]
        for a in p._actions
        if a.option_strings and not a.help and a.dest != "help"
    ]
    assert not undocumented, undocumented


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["keygen", "--dir", str(tmp_path), "--name", "n1"]) == 0
    secret = tmp_path / "n1.key_secret"
    before = secret.read_bytes()
    capsys.readouterr()
    assert main(["keygen", "--dir", str(tmp_path), "--name", "n1"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "n1.key") in err and "--force" in err
    assert secret.read_bytes() == before, "the secret key was replaced"
    assert main(["keygen", "--dir", str(tmp_path), "--name", "n1", "--force"]) == 0
    assert secret.read_bytes() != before


def test_pubkey_of_a_missing_file_says_so_and_how_to_make_it(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "peers.d" / "A.key"
    assert main(["pubkey", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"no such file: {missing}" in err and "Invalid certificate" not in err
    assert f"weightwire keygen --dir {missing.parent} --name A" in err
    assert main(["keygen", "--dir", str(tmp_path), "--name", "A"]) == 0
    capsys.readouterr()
    assert main(["pubkey", str(tmp_path / "A.key")]) == 0
    assert len(capsys.readouterr().out.strip()) == 40  # z85 of 32 bytes
