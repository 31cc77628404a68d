"""The daemon's command-line flags: one per setting of `DaemonConfig`, its help the
setting's documentation (configdoc). Apart from config.py so that configdoc, which reads
config.py's source, is not imported back by it."""

from __future__ import annotations

import argparse

from .config import DaemonConfig
from .configdoc import flag_help, settings


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, named like the setting (`--tcp-streams` for tcp_streams), its
    help the setting's documentation (configdoc)."""
    docs = {st.name: flag_help(st) for st in settings()}
    for name, ftype in DaemonConfig.__annotations__.items():
        flag = "--" + name.replace("_", "-")
        helptext = docs[name]
        if ftype.startswith("list"):
            parser.add_argument(flag, dest=name, action="append", help=helptext + " (repeatable)")
        elif ftype == "bool":
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=helptext
            )
        elif ftype == "int":
            parser.add_argument(flag, dest=name, type=lambda v: int(v, 0), help=helptext)
        elif ftype == "float":
            parser.add_argument(flag, dest=name, type=float, help=helptext)
        else:
            parser.add_argument(flag, dest=name, help=helptext)
