"""A trainer rank (an insider with a valid key: its own trailer and payload bytes) claiming
another rank's range in its delta trailer. Two trainer ranks on host0 write to one engine
rank on host1 (real daemons over tcp, own namespaces when root): rank 0 holds `a0`..`a7`,
rank 1 `b0`..`b7`, interleaved at the engine (one range each). In a delta version rank 0's
trailer drops some of its own ranges and names `b0`'s instead, and lists a payload (packed
into its trailer slot, after the trailer) that writes into `b0`, with a checksum that
matches the bytes it leaves there.

The engine once took a trailer's ranges at its word (only their total was checked): it
applied the payload into rank 1's bytes, and with rank 1's checksum of `b0` taken as its
bucket landed the version could even complete. The plan now tells the engine which
ranges each trailer's sender may write there (`Expect.planned`): the version fails
(`unauthorized`, naming the range) before anything of it is applied, is never reported
complete, `b0` holds rank 1's bytes bitwise, and the next version (dense) lands bitwise.
The engine's tensors in host memory, and (marked `gpu`) in GPU memory."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.delta import codec, digest, frames
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.plan import RankPlan, trailer_capacity

from .conftest import FAST, NETNS, serve
from .test_delta_e2e import SMALL

GPU = torch.cuda.is_available()

_jobs = itertools.count()
COLS = 64  # bf16 rows of 128 bytes; tensor i has 16 + 4 i of them (never one strided write)
OWN = [f"a{i}" for i in range(8)]
OTHER = [f"b{i}" for i in range(8)]
FORGED_AT = 1  # the version rank 0 forges (0 is dense; the engine holds it verified)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # a version's first writes into GPU memory over tcp start the engine daemon's CUDA
    # bounce (seconds on a cold machine): more than SMALL's 4 s
    extra = {**FAST, **SMALL, "version-timeout-s": "20"}
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra=extra))


def tensors(version: int) -> dict[str, torch.Tensor]:
    """Every version changes a few elements of each `a` (a sparse delta); the `b`s stay."""
    out = {}
    for i, name in enumerate(itertools.chain(*zip(OWN, OTHER, strict=True))):
        rows = 16 + 4 * i
        t = (torch.arange(rows * COLS, dtype=torch.float32) * 0.001 + i).reshape(rows, COLS)
        if name in OWN:
            t.view(-1)[version::97] += version
        out[name] = t.to(torch.bfloat16)
    return out


def b_range(plan: RankPlan) -> frames.Range:
    """Rank 1's range at the engine rank that is `b0` (the only tensor of its size: the
    engine's tensors may lie in one region or each in its own, as on a GPU)."""
    (w,) = [w for b in plan.buckets for w in b.writes if w.length == 2 * COLS * (16 + 4)]
    assert w.count == 1, w
    return (w.dst_region, w.dst_offset, w.length, w.count, w.dst_stride)


def align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """`got`'s tensors (on any device) hold `want`'s bytes."""
    return all(
        torch.equal(t.cpu().view(torch.uint8), want[n].view(torch.uint8)) for n, t in got.items()
    )


def forge_trailers(tr: Trainer, b: frames.Range, forged_b: torch.Tensor, gpu: bool) -> None:
    """Rank 0's trailer of version FORGED_AT claims `b0` (range `b`) in place of some of its
    own ranges, and a payload packed after it that leaves `forged_b` there; its checksum
    is what the engine would find."""
    sender = tr.delta
    honest = sender.trailers

    def forged(plan: RankPlan, out: torch.Tensor) -> tuple[int, ...]:
        lengths = honest(plan, out)
        if sender._version != FORGED_AT:
            return lengths
        (t,) = plan.trailers
        kept = sender._trailers
        dst = (t.dst_node, t.slot)
        ranges, parts = list(kept._ranges[dst]), list(kept._parts[dst])
        old = tensors(FORGED_AT)["b0"].view(-1).view(torch.uint8)
        new = forged_b.view(-1).view(torch.uint8)
        enc = codec.encode(new, old, 2, mode="on")
        head = frames.PayloadHead(
            kind=int(enc.kind),
            width=2,
            version=FORGED_AT,
            base=FORGED_AT - 1,
            elements=codec.elements(new.numel(), 2),
            count=enc.count,
            body_len=enc.body.numel(),
            blocks=(b,),
        )
        payload = frames.payload_head(head) + enc.body.numpy().tobytes()
        for drop in range(1, len(ranges) + 1):  # drop as few of its own as fit
            at = align(trailer_capacity(len(ranges) - drop + 1, 1))
            if at + len(payload) <= t.capacity:
                break
        else:
            raise AssertionError("no room for the forged payload in the trailer slot")
        claimed = [*ranges[drop:], b]
        sums = [*parts[drop:], digest.range_digest([new], gpu)]  # as the engine will hash
        data = frames.trailer(
            frames.TrailerHead(
                sender=plan.rank,
                version=FORGED_AT,
                base=FORGED_AT - 1,
                digest=digest.combine(sums),
                ranges=tuple(claimed),
                deltas=((t.dst_offset + at, len(payload)),),  # its own (early) not listed
            )
        )
        blob = bytearray(at + len(payload))
        blob[: len(data)] = data
        blob[at:] = payload
        forged_bytes = torch.frombuffer(blob, dtype=torch.uint8)
        out[t.src_offset : t.src_offset + len(blob)].copy_(forged_bytes)
        return (len(blob),)

    sender.trailers = forged  # type: ignore[method-assign]


def publish_both(trs: list[Trainer], version: int) -> dict[int, BaseException]:
    """Both ranks publish `version` at once; each one's error, if any."""
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        w = tensors(version)
        try:
            trs[rank].publish(version, {n: w[n] for n in (OWN if rank == 0 else OTHER)})
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="no GPU here")]
        ),
    ],
)
def test_a_trailer_claiming_another_ranks_range_fails_and_writes_nothing(
    cluster: LocalCluster, device: str
) -> None:
    job = f"trailer-claims{next(_jobs)}"
    w0 = tensors(0)
    dst = {n: torch.zeros_like(t, device=device) for n, t in w0.items()}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30, delta_area=1.0)
    trs = [
        Trainer(r, 2, socket=cluster.daemons[0].socket, job=job, timeout_s=30, delta="on")
        for r in range(2)
    ]
    try:
        eng.register(dst)
        trs[0].register({n: w0[n] for n in OWN})
        trs[1].register({n: w0[n] for n in OTHER})
        assert not publish_both(trs, 0)
        eng.wait(0)
        assert bitwise(dst, w0)
        b = b_range(trs[1].plan())
        forged_b = tensors(FORGED_AT)["b0"].clone()
        forged_b.view(-1)[:4] = 7.0  # not rank 1's
        forge_trailers(trs[0], b, forged_b, device == "cuda")
        errors = publish_both(trs, FORGED_AT)
        assert bitwise({"b0": dst["b0"]}, tensors(FORGED_AT)), "rank 1's bytes were overwritten"
        err = errors.get(0)
        assert isinstance(err, WeightwireError), f"the forged version completed: {errors}"
        assert err.code is ErrorCode.UNAUTHORIZED, err
        assert "range" in err.message and "not one the plan routes" in err.message, err.message
        with pytest.raises(WeightwireError):
            eng.wait(FORGED_AT, timeout_s=10)
        assert eng.delta is not None and eng.delta.held == -1
        # the daemons keep serving: the next version (dense, nothing verified held) lands
        assert not publish_both(trs, 2)
        eng.wait(2)
        assert bitwise(dst, tensors(2))
    finally:
        for tr in trs:
            tr.close()
        eng.close()
