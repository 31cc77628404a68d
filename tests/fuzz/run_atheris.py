"""libFuzzer (atheris) over one target: `python -m tests.fuzz.run_atheris TARGET CORPUS -runs=N`."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from tests.fuzz.targets import TARGETS


def main() -> None:
    target = TARGETS[sys.argv.pop(1)]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
