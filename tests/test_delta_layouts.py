"""Delta sync against model layouts weightwire did not choose, with real daemons.

slime's delta sync corrupted grouped-MoE weights (slime#2209): a loader hack that patched
`copy_` could not follow gate and up concatenated into one w13, experts stacked into one
3-D parameter, or a TP slice of each. Here the engine ranks' layouts are the ones SGLang
and vLLM use, fed by Recipes from the trainer's tensors (and the other way round), and
every version, dense first then deltas, is checked bitwise at every engine rank against
what a dense sync gives (the reference is built from the trainer's tensors the plain way:
slicing, concatenation, FP8 block quantization), with deltas actually sent:

- experts stacked and gate/up fused on the trainer, per-expert tensors on the engines,
  split by expert parallelism;
- per-expert tensors on the trainer, stacked w13 (gate|up) and w2 on the engines, each
  engine rank a TP slice of every expert (gate's rows and up's rows of its slice side by
  side: the layout slime#2209 broke);
- tied embeddings (one source tensor to two destinations of each rank) and a norm written
  whole to both TP ranks;
- an FP8 engine: codes and float32 scales from one bf16 source per expert, deltas of both;
- 1-element and odd-sized tensors, a 1-byte dtype with an odd count;
- trainer tensors that are views of one buffer, non-contiguous views (a transpose, every
  other column);
- each of them at densities where payloads stop fitting mid-compare, in "on" and "auto",
  and with segments split between two threads.

The same layouts on a GPU: `test_delta_layouts_gpu.py`; sources that change under us
(new storage, replans, another dtype): `test_delta_sources.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from weightwire.client import Engine, Recipe, Trainer
from weightwire.client.dtypes import TORCH
from weightwire.client.fp8 import quantize_blocks
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.tensors import Box, Cast, Fp8BlockQuant, Fp8BlockScale, Piece

from .conftest import FAST, NETNS, serve
from .test_delta_e2e import SMALL

_jobs = itertools.count()
E, I, H = 4, 96, 160  # experts, intermediate, hidden  # noqa: E741


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **SMALL}))


CPU = torch.device("cpu")


def bf16(
    g: torch.Generator, *shape: int, scale: float = 0.02, dev: torch.device = CPU
) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).to(dev)


def step(tensors: list[torch.Tensor], density: float, seed: int) -> None:
    """Change about `density` of the elements of each tensor in place, through whatever
    view it is (strided views included)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        mask = (torch.rand(t.shape, generator=g) < density).to(t.device)
        if t.dtype in (torch.uint8, torch.int8):
            t[mask] = t[mask] + 1
        else:
            t[mask] = (t[mask].float() + 0.01).to(t.dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8).reshape(-1)


def box_of(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


def reference(pieces: tuple[Piece, ...], nbytes: int, src: dict[str, torch.Tensor]) -> torch.Tensor:
    """A destination's bytes from the trainer's global tensors, built the plain way."""
    out = torch.zeros(nbytes, dtype=torch.uint8)
    for p in pieces:
        part = box_of(src[p.source], p.box).cpu()
        if isinstance(p.transform, Fp8BlockQuant):
            data = raw(quantize_blocks(part.reshape(part.shape[-2:]), p.transform.block)[0])
        elif isinstance(p.transform, Fp8BlockScale):
            data = raw(quantize_blocks(part.reshape(part.shape[-2:]), p.transform.block)[1])
        elif isinstance(p.transform, Cast):
            data = raw(part.to(TORCH[p.transform.dtype]))
        else:
            data = raw(part)
        out[p.dst_offset : p.dst_offset + data.numel()] = data
    return out


@dataclass
class Dest:
    tensor: torch.Tensor
    pieces: tuple[Piece, ...]


@dataclass
class Job:
    """A trainer rank's tensors (as registered: views included), the global tensors they
    are views of (for the reference), and each engine rank's destinations."""

    trainer: dict[str, torch.Tensor]
    globals_: Callable[[], dict[str, torch.Tensor]]
    engines: dict[int, dict[str, Dest]]
    mutable: list[torch.Tensor] = field(default_factory=list)  # what a step changes


def run(
    c: LocalCluster, job: Job, versions: int = 4, density: float = 0.02, mode: str = "on"
) -> None:
    """Dense, then `versions - 1` steps of `density`, each version bitwise at every
    engine rank; in mode "on" at low density deltas must have been sent."""
    name = f"layouts{next(_jobs)}"
    engines = {}
    try:
        for rank, dests in job.engines.items():
            eng = Engine(
                rank, len(job.engines), socket=c.daemons[-1].socket, job=name, timeout_s=30,
                delta_area=0.5,
            )  # fmt: skip
            engines[rank] = eng
            eng.register(
                {n: d.tensor for n, d in dests.items()},
                {n: Recipe(d.pieces) for n, d in dests.items()},
            )
        tr = Trainer(0, 1, socket=c.daemons[0].socket, job=name, timeout_s=30, delta=mode)
        try:
            tr.register(job.trainer)
            for v in range(versions):
                if v:
                    step(job.mutable or list(job.trainer.values()), density, v)
                stats = tr.publish(v)
                src = job.globals_()
                for rank, dests in job.engines.items():
                    engines[rank].wait(v)
                    for n, d in dests.items():
                        want = reference(d.pieces, d.tensor.nbytes, src)
                        assert torch.equal(raw(d.tensor), want), f"v{v} rank {rank}: {n} differs"
                    assert engines[rank].delta is not None and engines[rank].delta.held == v
                if v and mode == "on" and density < 0.1:
                    assert stats.delta_bytes > 4096, f"v{v}: no deltas sent ({stats})"
        finally:
            tr.close()
    finally:
        for eng in engines.values():
            eng.close()


def stacked_fused_experts_to_per_expert_ranks(dev: torch.device) -> tuple[Job, float]:
    """Trainer: experts stacked, gate|up fused (w13 [E, 2I, H]), w2 [E, H, I]. Engine
    ranks: per-expert gate, up, down, experts split over two ranks (EP)."""
    g = torch.Generator().manual_seed(1)
    w = {"experts.w13": bf16(g, E, 2 * I, H, dev=dev), "experts.w2": bf16(g, E, H, I, dev=dev)}
    engines: dict[int, dict[str, Dest]] = {}
    for rank in (0, 1):
        dests = {}
        for e in range(rank * E // 2, (rank + 1) * E // 2):
            parts = {
                "gate": ("experts.w13", Box(offsets=(e, 0, 0), sizes=(1, I, H)), (I, H)),
                "up": ("experts.w13", Box(offsets=(e, I, 0), sizes=(1, I, H)), (I, H)),
                "down": ("experts.w2", Box(offsets=(e, 0, 0), sizes=(1, H, I)), (H, I)),
            }
            for part, (source, box, shape) in parts.items():
                dests[f"experts.{e}.{part}"] = Dest(
                    torch.zeros(shape, dtype=torch.bfloat16, device=dev),
                    (Piece(source=source, box=box, dst_offset=0),),
                )
        engines[rank] = dests
    return Job(w, lambda: w, engines), 0.02


def test_stacked_fused_experts_to_per_expert_ranks(cluster: LocalCluster) -> None:
    """stacked_fused_experts_to_per_expert_ranks, on the CPU."""
    job, density = stacked_fused_experts_to_per_expert_ranks(CPU)
    run(cluster, job, density=density)


def per_expert_to_tp_sliced_fused_w13(dev: torch.device) -> tuple[Job, float]:
    """Trainer: per-expert gate, up, down. Engine ranks (TP 2): w13 [E, 2 * I/2, H], each
    expert's slice of gate rows then its slice of up rows; w2 [E, H, I/2] (columns)."""
    g = torch.Generator().manual_seed(2)
    w = {}
    for e in range(E):
        w[f"experts.{e}.gate"] = bf16(g, I, H, dev=dev)
        w[f"experts.{e}.up"] = bf16(g, I, H, dev=dev)
        w[f"experts.{e}.down"] = bf16(g, H, I, dev=dev)
    half = I // 2
    engines: dict[int, dict[str, Dest]] = {}
    for rank in (0, 1):
        w13, w2 = [], []
        for e in range(E):
            rows = Box.rows((I, H), rank * half, (rank + 1) * half)
            at = e * 2 * half * H * 2
            w13.append(Piece(source=f"experts.{e}.gate", box=rows, dst_offset=at))
            w13.append(Piece(source=f"experts.{e}.up", box=rows, dst_offset=at + half * H * 2))
            cols = Box.rows((H, I), rank * half, (rank + 1) * half, dim=1)
            w2.append(Piece(source=f"experts.{e}.down", box=cols, dst_offset=e * H * half * 2))
        engines[rank] = {
            "experts.w13": Dest(
                torch.zeros(E, 2 * half, H, dtype=torch.bfloat16, device=dev), tuple(w13)
            ),
            "experts.w2": Dest(
                torch.zeros(E, H, half, dtype=torch.bfloat16, device=dev), tuple(w2)
            ),
        }
    return Job(w, lambda: w, engines), 0.02


def test_per_expert_to_tp_sliced_fused_w13(cluster: LocalCluster) -> None:
    """per_expert_to_tp_sliced_fused_w13, on the CPU."""
    job, density = per_expert_to_tp_sliced_fused_w13(CPU)
    run(cluster, job, density=density)


def whole(name: str, t: torch.Tensor) -> Dest:
    piece = Piece(source=name, box=Box.full(tuple(t.shape)), dst_offset=0)
    return Dest(torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device), (piece,))


def tied_embeddings_and_replicated_norms(dev: torch.device) -> tuple[Job, float]:
    """One source tensor to two destinations of each engine rank (embed_tokens and
    lm_head tied); a norm whole to both TP ranks; 1-element and odd-sized tensors; a
    1-byte dtype with an odd count."""
    g = torch.Generator().manual_seed(3)
    V = 1000
    w = {
        "embed": bf16(g, V, H),
        "norm": (1 + torch.randn(H, generator=g) * 0.02).to(torch.bfloat16),
        "one": bf16(g, 1),
        "odd": bf16(g, 7, 13),
        "bytes": torch.randint(0, 200, (3, 11), generator=g, dtype=torch.uint8),
        "f32": torch.randn(33, generator=g),
    }
    w = {n: t.to(dev) for n, t in w.items()}
    engines: dict[int, dict[str, Dest]] = {}
    for rank in (0, 1):
        rows = Box.rows((V, H), rank * V // 2, (rank + 1) * V // 2)
        shape = (V // 2, H)
        engines[rank] = {
            "embed_tokens": Dest(torch.zeros(shape, dtype=torch.bfloat16, device=dev),
                                 (Piece(source="embed", box=rows, dst_offset=0),)),
            "lm_head": Dest(torch.zeros(shape, dtype=torch.bfloat16, device=dev),
                            (Piece(source="embed", box=rows, dst_offset=0),)),
            **{n: whole(n, w[n]) for n in ("norm", "one", "odd", "bytes", "f32")},
        }  # fmt: skip
    return Job(w, lambda: w, engines), 0.05


def test_tied_embeddings_and_replicated_norms(cluster: LocalCluster) -> None:
    """tied_embeddings_and_replicated_norms, on the CPU."""
    job, density = tied_embeddings_and_replicated_norms(CPU)
    run(cluster, job, density=density)


def fp8_engine_codes_and_scales(dev: torch.device) -> tuple[Job, float]:
    """An FP8 engine: per-expert bf16 sources quantized into stacked codes and float32
    scales (tiles of 128, the last ones partial); deltas of both."""
    g = torch.Generator().manual_seed(4)
    rows, cols = 200, 300
    tr_, tc_ = -(-rows // 128), -(-cols // 128)
    w = {f"experts.{e}.down": bf16(g, rows, cols, dev=dev) for e in range(E)}
    box = Box.full((rows, cols))
    codes = tuple(
        Piece(source=f"experts.{e}.down", box=box, dst_offset=e * rows * cols,
              transform=Fp8BlockQuant())
        for e in range(E)
    )  # fmt: skip
    scales = tuple(
        Piece(source=f"experts.{e}.down", box=box, dst_offset=e * tr_ * tc_ * 4,
              transform=Fp8BlockScale())
        for e in range(E)
    )  # fmt: skip
    engines = {
        0: {
            "w2": Dest(torch.zeros(E, rows, cols, dtype=torch.float8_e4m3fn, device=dev), codes),
            "w2_scale_inv": Dest(torch.zeros(E, tr_, tc_, dtype=torch.float32, device=dev), scales),
        }
    }
    return Job(w, lambda: w, engines), 0.02


def test_fp8_engine_codes_and_scales(cluster: LocalCluster) -> None:
    """fp8_engine_codes_and_scales, on the CPU."""
    job, density = fp8_engine_codes_and_scales(CPU)
    run(cluster, job, density=density)


def trainer_views_of_one_buffer_and_strided(dev: torch.device) -> tuple[Job, float]:
    """Trainer tensors that share storage (gate and up: halves of one w13 buffer, as a
    fused parameter's views), a transpose and every other column (non-contiguous): the
    in-place compare reads them where they are, packing copies them; a step changes the
    buffers through other views."""
    g = torch.Generator().manual_seed(5)
    w13 = bf16(g, 2 * I, H, dev=dev)
    base_t = bf16(g, H, I, dev=dev)
    wide = bf16(g, I, 2 * H, dev=dev)
    trainer = {
        "gate": w13[:I],
        "up": w13[I:],
        "down": base_t.t(),  # (I, H), non-contiguous
        "cols": wide[:, ::2],  # (I, H), every other column
    }
    engines = {0: {n: whole(n, t) for n, t in trainer.items()}}
    return Job(trainer, lambda: trainer, engines, mutable=[w13, base_t, wide]), 0.02


def test_trainer_views_of_one_buffer_and_strided(cluster: LocalCluster) -> None:
    """trainer_views_of_one_buffer_and_strided, on the CPU."""
    job, density = trainer_views_of_one_buffer_and_strided(CPU)
    run(cluster, job, density=density)


@pytest.mark.parametrize("density", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("mode", ["on", "auto"])
def test_layouts_at_high_density(cluster: LocalCluster, density: float, mode: str) -> None:
    """Every layout at densities where payloads stop fitting part way through a compare
    (the payload goes dense, the shadow and checksums must still be right, the bucket
    packed after its in-place compare) or where auto prefers dense: bitwise throughout."""
    for layout in LAYOUTS:
        job, _ = layout(CPU)
        run(cluster, job, versions=3, density=density, mode=mode)


def test_layouts_with_segments_split_between_two_threads(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a host with cores to spare: a segment's compare split between the caller
    and a helper thread (here every segment from 1 KiB), at low and high density."""
    from weightwire.client.delta import hostpass

    monkeypatch.setattr(hostpass, "THREADS", 2)
    monkeypatch.setattr(hostpass, "SPLIT_BYTES", 1024)
    for density in (0.02, 0.4):
        for layout in LAYOUTS:
            job, _ = layout(CPU)
            run(cluster, job, versions=3, density=density)


LAYOUTS = [
    stacked_fused_experts_to_per_expert_ranks,
    per_expert_to_tp_sliced_fused_w13,
    tied_embeddings_and_replicated_norms,
    fp8_engine_codes_and_scales,
    trainer_views_of_one_buffer_and_strided,
]
"""Each builds a job on a device (its tensors there): `tests/test_delta_layouts_gpu.py`
runs them on a GPU."""
