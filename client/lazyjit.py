"""A Triton kernel jit-compiled on its first launch.

Triton decides when it is imported whether jit functions are compiled for a GPU or run by
its interpreter (TRITON_INTERPRET=1). A kernel module defines its function only where
Triton is installed, and wraps it here: importing the module needs neither Triton nor a
GPU, and the function is compiled (or interpreted) the way Triton was imported."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class LazyKernel:
    """`kernel()` is `triton.jit(source())`, made on the first call."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source  # the plain Python function, looked up when first needed
        self._jitted: Any = None
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        if self._jitted is None:
            with self._lock:
                if self._jitted is None:
                    import triton

                    self._jitted = triton.jit(self._source())
        return self._jitted
