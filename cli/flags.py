"""Command-line conventions shared by the commands: deprecated flag spellings that warn.

Units are spelled in flag and field names: `gbit` is gigabits per second (a NIC's rate),
`gbyte_s` decimal gigabytes per second (a copy or a transfer's rate).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class Deprecated(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and warns on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, use: str, **kw: Any) -> None:
        self.use = use
        super().__init__(option_strings, dest, help=f"deprecated spelling of {use}", **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated, use {self.use} (same unit)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)
