"""The errors that end a `weightwire bench gpu` run."""

from __future__ import annotations


class RunError(RuntimeError):
    pass


class Interrupted(RunError):
    pass
