"""SGLang's HTTP calls around a weight update, as an async client, and the whole sequence,
importable from one place:

- `client`: `SGLangClient`, one server's pause/flush/begin/end/version/continue calls
- `update`: `update_weights`, that sequence on many servers at once, and `UpdateReport`
- `errors`: `SGLangError` and `SGLangTimeout`, what every failed call raises
- `wire`: HTTP/1.1 on asyncio streams (standard library only)
"""

from __future__ import annotations

from .client import PauseMode, Selector, SGLangClient
from .errors import SGLangError, SGLangTimeout
from .update import UpdateReport, update_weights
from .wire import MAX_BODY

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
