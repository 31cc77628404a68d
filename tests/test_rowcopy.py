"""The row-copy kernel behind strided pack copies: which views it takes, the bytes it
writes (on a GPU), and the one-by-one fallback where it cannot run."""

from __future__ import annotations

import sys

import pytest
import torch

from weightwire.client import rowcopy
from weightwire.client.rowcopy import RowCopies, Runs, runs_of

needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_base = torch.zeros(6, 10, 12)
_mat = torch.zeros(10, 12)


@pytest.mark.parametrize(
    ("view", "want"),
    [
        (_mat, Runs(1, 120, 120)),
        (_mat[2:5], Runs(1, 36, 36)),
        (_mat[:, 3:9], Runs(10, 6, 12)),
        (_mat[2:7, :4], Runs(5, 4, 12)),
        (_mat[4:5, 3:9], Runs(1, 6, 6)),
        (_base[:, :, 6:], Runs(60, 6, 12)),  # an expert stack's column halves: one run set
        (_base[1:3, 2:4, :], Runs(2, 24, 120)),
        (_base[1:3, 2:4, 1:5], None),  # two strides between runs
        (_mat.t(), None),
        (_mat[:, ::2], Runs(60, 1, 2)),  # runs of one element
        (_mat[:, 4:5], Runs(10, 1, 12)),
        (_base[:, 1:3, ::3], None),
    ],
)
def test_runs_of(view: torch.Tensor, want: Runs | None) -> None:
    assert runs_of(view) == want


def test_without_the_kernel_build_says_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Triton: the caller gets None (and copies one by one), nothing is half written."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "weightwire.client.rowcopy_kernel", raising=False)
    monkeypatch.setattr(rowcopy, "_kernel_failure_logged", False)
    src = torch.arange(40, dtype=torch.float32).view(4, 10)[:, 2:7]
    out = torch.zeros(4, 5)
    assert RowCopies.build([(out, src)]) is None
    assert not out.any()


def _pairs(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g)
        return raw.to(torch.uint8).view(dtype).to(device)

    experts = [rand(1024, 768, dtype=torch.bfloat16) for _ in range(4)]
    srcs = [e[:, h : h + 384] for e in experts for h in (0, 384)]  # the w2 halves
    odd = rand(37, 101, dtype=torch.uint8)
    srcs += [odd[:, 1:100], odd[3:30, 5:37]]  # byte runs at odd addresses
    wide = rand(9, 3000, dtype=torch.float32)
    srcs += [wide[:, 7:2999], wide[2:8, 1:9]]  # runs longer than one column block
    halfword = rand(70, 30, dtype=torch.float16)
    srcs += [halfword[:, 1:17]]  # 2-byte alignment only
    stack = rand(3, 50, 40, dtype=torch.bfloat16)
    srcs += [stack[:, :, 20:]]  # 3-D, one run set
    return [(torch.zeros(s.shape, dtype=s.dtype, device=device), s) for s in srcs]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_copies_land_bitwise_eagerly_and_from_a_graph(device: str) -> None:
    pairs = _pairs(device)
    assert all(RowCopies.accepts(o, s) for o, s in pairs)
    copies = RowCopies.build(pairs)
    assert copies is not None, "the row-copy kernel did not run (see the warning logged)"
    words = sorted(t.dtype.itemsize for _, t, _, _ in copies.groups)
    assert words == [1, 2, 4, 8]
    for out, src in pairs:
        assert torch.equal(out.view(torch.uint8), src.contiguous().view(torch.uint8))
    for out, src in pairs:
        out.zero_()
        src.bitwise_not_() if src.dtype == torch.uint8 else src.neg_()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        copies.run()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    for out, src in pairs:
        assert torch.equal(out.view(torch.uint8), src.contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_more_tiles_than_a_grid_row_holds(device: str) -> None:
    """4.3M runs of 33 bytes: more row tiles than one grid dimension takes, so programs
    loop over tiles."""
    n = 4_300_000
    raw = torch.randint(0, 256, (n, 34), dtype=torch.uint8, device=device)
    src = raw[:, 1:]
    out = torch.zeros(src.shape, dtype=torch.uint8, device=device)
    assert RowCopies.build([(out, src)]) is not None
    assert torch.equal(out, src)


def test_views_not_taken() -> None:
    """CPU tensors, short runs (torch's own copy is as fast), or no even spacing."""
    assert not RowCopies.accepts(torch.zeros(4, 8), torch.zeros(4, 10)[:, 2:10])
    if torch.cuda.is_available():
        m = torch.zeros(4, 30, device="cuda")
        assert RowCopies.accepts(torch.zeros(4, 8, device="cuda"), m[:, 2:10])
        assert not RowCopies.accepts(torch.zeros(4, 7, device="cuda"), m[:, 2:9])
        assert not RowCopies.accepts(torch.zeros(4, 8, device="cuda").t(), m[:, 2:10].t())
