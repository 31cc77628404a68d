"""tests/sglang runs only where SGLang is importable (`.venv-sglang`, made by
scripts/sglang-env.sh; `make test-sglang`). Elsewhere each module skips itself at import,
before touching SGLang or scripts/sglang_cpu.py."""

from __future__ import annotations

import importlib.util
import os
import sys

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts")

if HAVE_SGLANG and SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
