import os
import sys

# `tests` is importable as a package so transport suites can share the conformance tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
