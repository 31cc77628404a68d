"""The Triton copy kernel (`client/copy_kernel.py`): a bucket's plain copies in one launch,
bitwise, bytes outside the pairs untouched; through `BucketPack` (plain copies to the
kernel, casts and strided ones to torch). On CPU through Triton's interpreter, in a pytest
of its own with TRITON_INTERPRET=1 (`test_cpu_tests_through_the_interpreter`); the GPU
tests (`-m gpu`) run the compiled kernel, into staging and inside the bucket's CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from weightwire.client import buckets as bucketsmod
from weightwire.client import copy_kernel
from weightwire.client import pack as packmod
from weightwire.client.copy_kernel import CHUNK, CopyBatch
from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy

from .interpreted import CUDA, INTERP, NEEDS_TRITON, OUTSIDE, run_interpreted
from .test_fp8 import pack_runs_op_by_op

pytestmark = NEEDS_TRITON


@OUTSIDE
def test_cpu_tests_through_the_interpreter() -> None:
    run_interpreted(__file__, "WEIGHTWIRE_COPY_TRITON", "4", timeout_s=600)


def _pairs(
    sizes: list[int], offsets: list[int], device: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, list[torch.Tensor]]:
    """Sources of `sizes` bytes (separate tensors, random bytes) and views of one
    destination at `offsets` (bytes), which starts filled with 0xA5."""
    g = torch.Generator().manual_seed(sum(sizes))
    item = torch.empty((), dtype=dtype).element_size()
    srcs = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).to(device)
        if n % item == 0
        else torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)
        for n in sizes
    ]
    end = max(o + n for o, n in zip(offsets, sizes, strict=True)) + 64
    dst = torch.full((end,), 0xA5, dtype=torch.uint8, device=device)
    return [(s, dst[o : o + s.nbytes]) for s, o in zip(srcs, offsets, strict=True)], dst, srcs


def _check(sizes: list[int], offsets: list[int], device: str = "cpu") -> CopyBatch:
    pairs, dst, srcs = _pairs(sizes, offsets, device)
    batch = CopyBatch(pairs)
    batch.run()
    got = dst.cpu()
    touched = torch.zeros_like(got, dtype=torch.bool)
    for s, o in zip(srcs, offsets, strict=True):
        assert torch.equal(got[o : o + s.nbytes], s.cpu().reshape(-1).view(torch.uint8)), o
        touched[o : o + s.nbytes] = True
    assert (got[~touched] == 0xA5).all()
    return batch


@INTERP
def test_aligned_pairs_one_launch_bitwise() -> None:
    """Pairs as the planner lays them out (16-byte multiples): one aligned launch, one
    program per chunk, pairs longer than a chunk and shorter than one, and an empty one."""
    sizes = [CHUNK * 2 + 4096, 32, CHUNK, 0, 1024]
    offsets = [4096, 0, 4096 + CHUNK * 2 + 4096, 100 * 16, 64]
    batch = _check(sizes, offsets)
    assert [a for a, *_ in batch.launches] == [True]
    assert batch.launches[0][3] == 3 + 1 + 1 + 1  # chunks


@INTERP
def test_unaligned_pairs_take_the_byte_launch() -> None:
    sizes = [CHUNK + 7, 18, 64, 6]
    offsets = [3, CHUNK + 40, CHUNK + 96, CHUNK + 170]  # 18 and 6 bytes: odd lengths
    batch = _check(sizes, offsets)
    assert [a for a, *_ in batch.launches] == [False, True]  # 64 bytes at +96: aligned


@INTERP
def test_bucket_pack_copies_through_the_kernel() -> None:
    """A bucket of contiguous copies (one launch), a strided copy and a cast (torch),
    bitwise against packing op by op, run after run (tensors changed in place)."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn((40, 24), generator=g).to(torch.bfloat16) for i in range(5)}
    tensors["f"] = torch.randn((16, 8), generator=g)
    ops, offset = [], 0
    for name, box, transform, n in [
        *((f"w{i}", Box.full((40, 24)), Copy(), 40 * 24 * 2) for i in range(4)),
        ("w4", Box.rows((40, 24), 3, 11), Copy(), 8 * 24 * 2),
        ("w4", Box.rows((40, 24), 0, 8, dim=1), Copy(), 40 * 8 * 2),  # strided
        ("f", Box.full((16, 8)), Cast(dtype="bfloat16"), 16 * 8 * 2),
    ]:
        ops.append(
            PackOp(source=name, box=box, transform=transform, staging_offset=offset, nbytes=n)
        )
        offset = -(-(offset + n) // 16) * 16
    p = packmod.Packer()
    pack_runs_op_by_op(p, tuple(ops), tensors, torch.zeros(offset, dtype=torch.uint8), runs=2)
    (entry,) = p._buckets.values()
    assert entry.plain is not None and len(entry.plain.pairs) == 5
    assert len(entry.copies) == 2  # the strided copy and the cast


@INTERP
def test_a_failing_copy_kernel_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(copy_kernel.CopyBatch, "run", boom)
    monkeypatch.setattr(bucketsmod, "_copy_failed", False)
    t = {"w": torch.arange(64, dtype=torch.float32)}
    ops = (PackOp(source="w", box=Box.full((64,)), transform=Copy(), staging_offset=0, nbytes=256),)
    got = torch.zeros(256, dtype=torch.uint8)
    p = packmod.Packer()
    p.pack_bucket(ops, t, got)
    assert torch.equal(got.view(torch.float32), t["w"])
    (entry,) = p._buckets.values()
    assert entry.plain is None and entry.copies and bucketsmod._copy_failed


# --- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@CUDA
def test_cuda_copy_kernel_bitwise() -> None:
    """Expert-sized pairs (3 MiB, as the colocated bench's) and odd ones, compiled."""
    sizes = [3 << 20] * 6 + [CHUNK + 7, 48, 2 << 20]
    offsets, at = [], 256
    for n in sizes:
        offsets.append(at + (3 if n % 16 else 0))
        at = -(-(offsets[-1] + n) // 16) * 16 + 16 * (len(offsets) % 3)
    batch = _check(sizes, offsets, device="cuda")
    assert [a for a, *_ in batch.launches] == [False, True]


@pytest.mark.gpu
@CUDA
def test_cuda_bucket_copies_in_its_graph() -> None:
    """The copy launch is captured in the bucket's CUDA graph; replays read the sources as
    they are (changed in place), bitwise against op by op."""
    tensors = {
        f"w{i}": torch.randn((768, 2048), device="cuda").to(torch.bfloat16) for i in range(8)
    }
    ops, offset = [], 0
    for i in range(8):
        n = 768 * 2048 * 2
        ops.append(PackOp(source=f"w{i}", box=Box.full((768, 2048)), transform=Copy(),
                          staging_offset=offset, nbytes=n))  # fmt: skip
        offset += n + 16 * i
    p = packmod.Packer()
    got = torch.zeros(offset, dtype=torch.uint8, device="cuda")
    pack_runs_op_by_op(p, tuple(ops), tensors, got, runs=4)
    (entry,) = p._buckets.values()
    assert entry.plain is not None and entry.graph is not None and not entry.copies
