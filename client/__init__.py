"""Client libraries (torch): trainer ranks publish, engine ranks receive."""

from .engine import Engine, Recipe, Rows, VersionInfo
from .layouts import Full, Part, Shard
from .trainer import PublishStats, Trainer

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
