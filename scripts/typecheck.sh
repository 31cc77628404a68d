#!/usr/bin/env bash
# mypy strict on weightwire.protocol, .transport, .memory, .daemon, .plan and .client. The folders are mapped into the
# `weightwire` package by pyproject, which mypy cannot follow, so give it a tree of links.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=.venv/typecheck/weightwire
mkdir -p "$tree"
ln -sfn "$PWD/weightwire/__init__.py" "$tree/__init__.py"
for pkg in daemon transport memory protocol client cli bench harness plan; do ln -sfn "$PWD/$pkg" "$tree/$pkg"; done
MYPYPATH=.venv/typecheck exec .venv/bin/python -m mypy -p weightwire.protocol -p weightwire.transport -p weightwire.memory \
    -p weightwire.daemon -p weightwire.plan -p weightwire.client "$@"
