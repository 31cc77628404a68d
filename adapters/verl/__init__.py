"""weightwire as a verl checkpoint-engine backend (verl 0.9.x).

Importing `weightwire.adapters.verl` registers the backend `weightwire` in verl's
`CheckpointEngineRegistry` (the way verl registers its own, with its decorator); select it
with `checkpoint_engine.backend=weightwire` and
`checkpoint_engine.custom_backend_module=weightwire.adapters.verl` (README, "verl").
This package imports verl and torch only when it is imported.
"""

from .checkpoint_engine import WeightwireCheckpointEngine, use_module

__all__ = ["WeightwireCheckpointEngine", "use_module"]
