"""SGLang's HTTP calls around a weight update, as an async client, and the whole sequence,
importable from one place:

- `client`: `SGLangClient`, one server's pause/flush/begin/end/version/continue calls
- `update`: `update_weights`, that sequence on many servers at once, and `UpdateReport`
- `errors`: `SGLangError` and `SGLangTimeout`, what every failed call raises

HTTP is httpx (the `[sglang]` extra).
"""

from __future__ import annotations

from .client import MAX_BODY, PauseMode, Selector, SGLangClient
from .errors import SGLangError, SGLangTimeout
from .update import UpdateReport, update_weights

__all__ = [
    "MAX_BODY",
    "PauseMode",
    "SGLangClient",
    "SGLangError",
    "SGLangTimeout",
    "Selector",
    "UpdateReport",
    "update_weights",
]
