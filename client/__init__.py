"""Client libraries (torch): trainer ranks publish, engine ranks receive.

The names below are imported on first use, so torch-free parts (`client.connection`,
`client.status`, which `weightwire status` uses) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine, VersionInfo
    from .feeds import Recipe, Rows
    from .layouts import Full, Part, Shard
    from .posting import PublishStats
    from .trainer import Trainer

_WHERE = {
    "Engine": "engine",
    "Recipe": "feeds",
    "Rows": "feeds",
    "VersionInfo": "engine",
    "Full": "layouts",
    "Part": "layouts",
    "Shard": "layouts",
    "PublishStats": "posting",
    "Trainer": "trainer",
}

__all__ = [
    "Engine",
    "Full",
    "Part",
    "PublishStats",
    "Recipe",
    "Rows",
    "Shard",
    "Trainer",
    "VersionInfo",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
