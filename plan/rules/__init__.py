"""Model-family rules: which HF-named source tensors make each SGLang engine tensor.

The public API (other modules build on exactly these names):

- `hf_tensors(config, dtype)`: the checkpoint's tensors (what trainer ranks hold once
  gathered), with HF names.
- `engine_tensors(config, layout)`: every tensor an SGLang engine rank at `layout` holds
  (SGLang names), each with its recipe (pieces from HF tensors).
- `resolve(declared, layout)`: fills in the pieces of declared destination tensors that
  left them to the rules; raises PlanError listing every name it cannot map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import DestTensor, Piece


@dataclass(frozen=True)
class HfTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class EngineTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def hf_tensors(config: Mapping[str, Any], dtype: str = "bfloat16") -> list[HfTensor]:
    raise NotImplementedError("being written (issue 3)")


def engine_tensors(config: Mapping[str, Any], layout: EngineLayout) -> list[EngineTensor]:
    raise NotImplementedError("being written (issue 3)")


def resolve(declared: Sequence[DestTensor], layout: EngineLayout) -> tuple[DestTensor, ...]:
    raise NotImplementedError("being written (issue 3)")
