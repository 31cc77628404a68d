"""What a trainer rank declared: its named tensors (plain, module parameters, Megatron
pieces), their specs and zero-copy regions, and the tensors a publish reads (checked
against what was registered)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import DeclareSources, LocalMessage, LocalMsg
from weightwire.protocol.tensors import SourceTensor

from .dtypes import TORCH, name_of
from .layouts import Full, Layout, Part, Shard, local_box
from .modules import ModuleShard, local_of
from .sources import SourceRegions

if TYPE_CHECKING:
    from .megatron import MegatronSource


class Requests(Protocol):
    """The daemon session, as the registry uses it: requests only."""

    def request(self, msg: LocalMsg, timeout_s: float = 30.0) -> LocalMessage: ...


@dataclass
class Registered:
    tensor: torch.Tensor
    spec: SourceTensor
    shape: torch.Size = field(init=False)  # the local shape registered

    def __post_init__(self) -> None:
        self.shape = self.tensor.shape


class SourceRegistry:
    """The tensors a trainer rank declared to its daemon (see `Trainer.register`)."""

    def __init__(self, conn: Requests, regions: SourceRegions) -> None:
        self._conn = conn
        self.regions = regions
        self.tensors: dict[str, Registered] = {}
        self._module_params: dict[str, torch.Tensor] = {}  # name -> DTensor (register_module)
        self._megatron: list[MegatronSource] = []  # register_megatron
        self._snapshot: dict[str, torch.Tensor] | None = None  # name -> tensor, as registered
        # the dtype and local shape of each, in the snapshot's order (what a publish checks)
        self._dtypes: list[torch.dtype] = []
        self._shapes: list[torch.Size] = []
        self._numels: list[int] = []
        self._ptrs: list[int] = []  # the tensors' addresses the last publish checked

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout | Mapping[str, Layout] | None,
        global_shapes: Mapping[str, tuple[int, ...]] | None,
        zero_copy: bool,
    ) -> None:
        """Named tensors this rank holds (see `Trainer.register`)."""
        specs = []
        for name, t in tensors.items():
            lay = layout.get(name, Full()) if isinstance(layout, Mapping) else (layout or Full())
            if not isinstance(lay, Full | Shard | Part):
                raise RegistrationError(
                    f"tensor {name}: layout {lay!r} is no Full(), Shard(dim, index, count) or "
                    "Part(offsets, sizes)",
                    code=ErrorCode.INVALID,
                )
            shape = tuple((global_shapes or {}).get(name, tuple(t.shape)))
            box = local_box(lay, shape, tuple(t.shape))
            region, offset = self.regions.region_of(t, zero_copy)
            spec = SourceTensor(
                name=name,
                dtype=name_of(t.dtype),
                shape=shape,
                box=box,
                region=region,
                offset=offset,
            )
            specs.append(spec)
        self.declare({s.name: (s, tensors[s.name]) for s in specs})

    def declare(self, entries: Mapping[str, tuple[SourceTensor, torch.Tensor]]) -> None:
        for name in entries:
            if name in self.tensors:
                raise RegistrationError(
                    f"tensor {name} is already registered", code=ErrorCode.DUPLICATE
                )
        self._conn.request(DeclareSources(tensors=tuple(spec for spec, _ in entries.values())))
        for name, (spec, t) in entries.items():
            self.tensors[name] = Registered(t, spec)
        self._snapshot = None

    def add_module(
        self, shards: Sequence[ModuleShard], *, zero_copy: bool = False
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """A module's parameters, as `module_shards` gives them (see `Trainer.register_module`)."""
        self.register(
            {s.name: s.local for s in shards},
            layout={s.name: Part(s.box.offsets, s.box.sizes) for s in shards},
            global_shapes={s.name: s.shape for s in shards},
            zero_copy=zero_copy,
        )
        self._module_params.update({s.name: s.param for s in shards})
        return {s.name: (s.box.offsets, s.box.sizes) for s in shards}

    def add_megatron(
        self, source: MegatronSource, *, zero_copy: bool = False
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """A Megatron model's pieces (see `Trainer.register_megatron`)."""
        pieces = source.pieces
        entries = {}
        for p in pieces:
            region, offset = self.regions.region_of(p.local, zero_copy)
            spec = SourceTensor(
                name=p.name,
                dtype=name_of(p.local.dtype),
                shape=p.shape,
                box=p.box,
                region=region,
                offset=offset,
            )
            entries[p.name] = (spec, p.local)
        self.declare(entries)
        self._megatron.append(source)
        return {p.name: (p.box.offsets, p.box.sizes) for p in pieces}

    def device(self) -> torch.device:
        for r in self.tensors.values():
            if r.tensor.is_cuda:
                return r.tensor.device
        return torch.device("cpu")

    def current(self, tensors: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """What a publish reads: the registered tensors, module parameters and Megatron
        parameters given new storage since, and `tensors` in place of registered ones."""
        if self._module_params:
            moved = self._module_tensors()
            if moved:
                tensors = {**moved, **(tensors or {})}
        for source in self._megatron:  # parameters given new storage: read them there
            for name, t in source.moved().items():
                reg = self.tensors[name]
                if reg.spec.region >= 0:
                    raise RegistrationError(
                        f"{name} was registered zero-copy, but its Megatron parameter has new "
                        "storage since: register with zero_copy=False to publish parameters "
                        "that move (offloaded and reloaded)",
                        code=ErrorCode.INVALID,
                    )
                reg.tensor = t  # from now on, as if registered so
                self._snapshot = None
        return self._current(tensors)

    def release(self) -> None:
        """Hold no reference to the storage of module and Megatron parameters (see
        `Trainer.release_parameters`); zero-copy ones stay, their memory is registered."""
        kept = {n for n, r in self.tensors.items() if r.spec.region >= 0}
        for source in self._megatron:
            source.release(kept)
        names = [p.name for s in self._megatron for p in s.pieces] + list(self._module_params)
        for name in names:
            reg = self.tensors[name]
            if name not in kept:
                reg.tensor = torch.empty(0, dtype=reg.tensor.dtype, device=reg.tensor.device)
        self._snapshot, self._ptrs = None, []

    def _module_tensors(self) -> dict[str, torch.Tensor]:
        """Module parameters given new storage since they were registered (offloaded and
        reloaded, `param.data = ...`): each is read where it is now, and from now on as if
        registered so, so this rank no longer holds the old storage (it used to, for ever:
        a parameter offloaded to the CPU and back kept its first GPU storage alive beside
        the new one). Zero-copy ones are returned instead, for `_current` to refuse."""
        out = {}
        for name, param in self._module_params.items():
            reg = self.tensors[name]
            local = local_of(param)
            if local is reg.tensor or (local.data_ptr(), local.shape) == (
                reg.tensor.data_ptr(),
                reg.tensor.shape,
            ):
                continue
            if reg.spec.region >= 0:
                out[name] = local
            else:
                reg.tensor = local
                self._snapshot = None
        return out

    def _current(self, tensors: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Read-only for the caller: with no `tensors`, the same dict every publish (made
        once per registration, not once per publish: 5000 tensors cost 0.3 ms a version)."""
        if self._snapshot is None:
            self._snapshot = {name: r.tensor for name, r in self.tensors.items()}
            self._dtypes = [TORCH[r.spec.dtype] for r in self.tensors.values()]
            self._shapes = [r.shape for r in self.tensors.values()]
            self._numels = [s.numel() for s in self._shapes]
            self._ptrs = []
        if not tensors:
            self._check(self._snapshot)
            return self._snapshot
        current = dict(self._snapshot)
        for name, t in (tensors or {}).items():
            reg = self.tensors.get(name)
            if reg is None:
                raise RegistrationError(
                    f"publish got tensor {name!r}, which this rank never registered",
                    code=ErrorCode.UNKNOWN_TENSOR,
                )
            if reg.spec.region >= 0 and t is not reg.tensor:
                raise RegistrationError(
                    f"tensor {name} is zero-copy (the daemon reads its registered memory): "
                    "update it in place instead of passing another tensor to publish",
                    code=ErrorCode.INVALID,
                )
            if t.dtype != TORCH[reg.spec.dtype]:
                raise RegistrationError(
                    f"tensor {name}: published as {t.dtype}, registered as {TORCH[reg.spec.dtype]}",
                    code=ErrorCode.DTYPE_MISMATCH,
                )
            if t.shape != reg.shape:
                raise RegistrationError(
                    f"tensor {name}: published with shape {list(t.shape)}, registered with "
                    f"{list(reg.shape)}",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            current[name] = t
        self._check(current)
        return current

    def _check(self, current: dict[str, torch.Tensor]) -> None:
        """Raises RegistrationError naming the first tensor a publish would read as other
        bytes than registered: a registered parameter given storage of another dtype or
        shape since (`param.data = ...`), or whose storage was freed (resized to nothing,
        as FSDP frees a parameter): packing would send its bytes as they are (fp16 bits as
        bf16), slice other elements, or read freed memory. New storage has a new address
        and freed storage has address 0, so every publish takes the addresses only, in a
        C loop (`map`: 18,000 tensors 0.3-0.9 ms), and dtypes, element counts and shapes
        only when some address moved since the last check. Unseen: a view of the same
        storage at the same address (`param.data = param.data.t()`, or `.view(dtype)`,
        which keeps the bytes)."""
        objs = list(current.values())
        ptrs = list(map(_DATA_PTR, objs))
        if ptrs == self._ptrs:  # where the last check found them
            return
        if (
            0 not in ptrs
            and list(map(_DTYPE, objs)) == self._dtypes
            and list(map(_NUMEL, objs)) == self._numels
            and list(map(_SHAPE, objs)) == self._shapes
        ):
            self._ptrs = ptrs
            return
        expected = zip(current.items(), self._dtypes, self._shapes, strict=True)
        for (name, t), dtype, shape in expected:
            if t.dtype != dtype:
                raise RegistrationError(
                    f"tensor {name} is {t.dtype} now, registered as {dtype} (its storage "
                    "was replaced since): publish it in its registered dtype",
                    code=ErrorCode.DTYPE_MISMATCH,
                )
            if t.shape != shape:
                raise RegistrationError(
                    f"tensor {name} has shape {list(t.shape)} now, registered with "
                    f"{list(shape)} (its storage was replaced since)",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            if t.numel() and (t.is_meta or t.untyped_storage().nbytes() == 0):
                raise RegistrationError(
                    f"tensor {name} has no data (its storage was freed, as FSDP frees "
                    "parameters after use, or it is on the meta device): give it its bytes "
                    "back before publishing",
                    code=ErrorCode.INVALID,
                )
        self._ptrs = ptrs  # only empty tensors at address 0: checked once, not every publish

    def declare_again(self) -> None:
        """The daemon restarted: zero-copy source regions again (the new daemon numbers
        them anew), the tensor specs pointed at their new ids, and declared again."""
        renamed = self.regions.register_again()
        for reg in self.tensors.values():
            if reg.spec.region in renamed:
                reg.spec = msgspec.structs.replace(reg.spec, region=renamed[reg.spec.region])
        if self.tensors:
            self._conn.request(DeclareSources(tensors=tuple(r.spec for r in self.tensors.values())))


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NUMEL = torch.Tensor.numel
_DATA_PTR = torch.Tensor.data_ptr
