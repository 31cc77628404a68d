"""The trainer side: declare what this rank holds; `publish` each version on its own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from weightwire.protocol.errors import PeerLostError, TimeoutError_, error_from_code
from weightwire.protocol.local import AbortVersion, LocalMessage, PublishResult, TrailersReady
from weightwire.protocol.plan import RankPlan, StagingRing

from .bucketloop import pack_buckets
from .bucketpack import BucketPacking
from .delta.sender import DeltaSender, Mode
from .direct import Direct
from .gilswitch import fast_switching
from .inputs import tensors_of, timeout_of, version_of
from .layouts import Layout
from .modules import Rename, module_shards
from .pack import Packer
from .pending import PendingVersions
from .posting import Poster, PublishStats
from .rank import RankClient
from .rankstaging import RankStaging
from .registry import SourceRegistry
from .ring import SlotOps
from .slotreuse import SlotReuse, VersionSlots
from .slotwait import SlotWaits
from .sources import SourceRegions
from .streams import OwnStreams
from .versionstart import VersionStart, publish_stats

if TYPE_CHECKING:
    from .megatron import Ranks


class Trainer(RankClient):
    """One trainer rank. `publish` returns once this rank's writes have all landed."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        socket: str | None = None,
        job: str = "default",
        timeout_s: float = 300.0,
        device: int | None = None,
        staging: Literal["auto", "gpu", "cpu"] = "auto",
        staging_buckets: int = 4,
        delta: Mode = "off",
        direct: bool = False,
        slot_events: bool = True,
        slot_counters: bool = True,
        gate_copies: bool = True,
    ) -> None:
        """`staging`: where buckets are packed. "gpu" (the default when the tensors are on a
        GPU) keeps everything on the device; "cpu" is the pinned CPU replica in the
        engines' layout (host memory the daemon sends from, e.g. over tcp or RDMA).

        `staging_buckets`: staging is a ring of this many bucket slots; bucket k is packed
        into slot k mod N once every write of the bucket packed there before it has finished.
        0 stages the whole send (as much memory as this rank sends). A plan with no more
        buckets than that is staged whole either way.

        `slot_events`: with GPU staging, a slot whose bucket went out by cuda copies only
        is reused as soon as the daemon has queued those copies: the packing stream waits
        on the daemon's CUDA IPC events (`BucketsIssued`) instead of this thread waiting
        for the landing. Any other destination (tcp, RDMA, host memory), or no IPC events,
        and the slot waits for the landing as before.

        `slot_counters`: with GPU staging, the packing stream waits for a ring slot on the
        GPU itself (cuStreamWaitValue32 on a counter per slot at the end of staging, which
        the daemon writes once the slot's last bucket is read: right after its cuda copies,
        on the GPU, or when it lands), and this thread never waits for the daemon. Used
        where the driver has stream memory operations and the plan sends no deltas; it
        takes precedence over `slot_events`.

        `gate_copies`: with GPU staging (a ring or the whole send), each bucket is posted
        to the daemon as soon as its packing is queued, not once it is done: the packing
        stream then writes the bucket's number into a pack counter at the end of staging
        (cuStreamWriteValue32), and the daemon's copies wait on the GPU for it
        (`BeginVersion.gate_offset`). With slot counters too, this thread never waits on the
        GPU within a version: packing, posting and copying chain on the GPU alone. Used
        where the driver has stream memory operations, the daemon says it can, and the plan
        sends no deltas and packs nothing in place (`direct`).

        `delta`: sparse delta sync to engine ranks that registered a delta area: "auto"
        sends each bucket as a delta payload where that is smaller, "on" wherever it fits,
        "off" always dense. Those engines verify every version (checksums) either way. It
        keeps a shadow of the whole send (the bytes last sent, `RankPlan.shadow_bytes`) on
        the staging's device, and a delta-out region (`RankPlan.delta_bytes`).

        `direct`: buckets whose every write lands on this rank's own GPU (an engine
        colocated with it) are packed straight into the engine's memory, with no staging
        hop and no copy; the daemon only delivers their immediates (see `client/direct.py`).
        Other buckets, and delta-capable plans, go through staging as before."""
        if staging_buckets < 0:
            raise ValueError(f"staging_buckets must be >= 0, got {staging_buckets}")
        self.placement = staging
        self.staging_buckets = staging_buckets
        self.slot_counters = slot_counters
        self.gate_copies = gate_copies
        self._slots = SlotWaits()
        self._reuse = SlotReuse(self._slots, slot_events)
        self._delta = DeltaSender(delta)
        self._pending = PendingVersions()
        super().__init__(
            "trainer",
            rank,
            world_size,
            socket=socket,
            job=job,
            timeout_s=timeout_s,
            device=device,
        )
        self._source_regions = SourceRegions(self._conn, rank)
        self._sources = SourceRegistry(self._conn, self._source_regions)
        self._packer = Packer()
        self._slot_ops = SlotOps()
        self._packing = BucketPacking(
            self._packer, self._slot_ops, self._delta, self._source_regions.host_bytes
        )
        self._direct = Direct() if direct else None
        self._stage = RankStaging(self._conn, rank, self._device, self._slots, self._direct, self)
        self._start = VersionStart(self._conn, self._stage, self._device, self._slots)
        self._pack_streams = OwnStreams()  # this rank's packing stream per device

    # --- registration --------------------------------------------------------

    def allocate(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Tensors that live in memory the daemon reads directly (zero-copy sources).

        Registered later with `register`, their untransformed parts are written to the
        engines straight from here: no packing, no staging copy (the CPU-replica way). Keep
        them unchanged while a publish runs.
        """
        return self._source_regions.allocate(specs)

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout | Mapping[str, Layout] | None = None,
        global_shapes: Mapping[str, tuple[int, ...]] | None = None,
        *,
        zero_copy: bool = False,
    ) -> None:
        """Declare named tensors this rank holds, and which part of each global tensor.

        `layout` is one Layout for all, or one per name (default Full). For a sharded
        tensor give its global shape in `global_shapes` (default: the local shape).

        `zero_copy=True`: the daemon reads the GPU tensors' own memory (their allocations,
        registered once here through CUDA IPC) for every part the engines take unchanged
        and contiguous, with no packing. Keep such tensors where they are (no re-allocation)
        and unchanged while a publish runs; publish them as registered (no replacements).
        Tensors from `Trainer.allocate` are always zero-copy.
        """
        self._sources.register(
            tensors_of(tensors, "register"), layout, global_shapes, zero_copy=zero_copy
        )
        self._start.forget_plan(declared=True)

    def register_module(
        self, module: torch.nn.Module, rename: Rename | None = None, *, zero_copy: bool = False
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Register a module's parameters as this rank holds them (FSDP2 DTensors: the box
        each local shard is, from its mesh and placements; plain parameters: whole).

        HF names are the parameter names without torch's wrapper parts (`_orig_mod.`, ...),
        passed through `rename` when given (return None to leave a parameter out). Each
        publish reads the parameters' local tensors as they are then. A placement that gives
        no box of the global tensor raises RegistrationError naming the parameter; nothing
        is registered then. Returns {HF name: (offsets, sizes)} of what was registered.
        """
        boxes = self._sources.add_module(module_shards(module, rename), zero_copy=zero_copy)
        self._start.forget_plan(declared=True)
        return boxes

    def register_megatron(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Mapping[str, Any],
        ranks: Ranks | None = None,
        *,
        skip: Callable[[str], bool] | None = None,
        zero_copy: bool = False,
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Register a Megatron-core GPTModel (or its virtual-pipeline chunks) as this rank
        holds it: each local parameter as the boxes of HF tensors it holds (interleaved QKV,
        fused gate/up, experts over EP, expert TP, pipeline stages, padded vocabulary; see
        `weightwire.client.megatron`), with no gather. `config`: the HF config the engines
        use. `ranks`: TP/EP/expert-TP ranks (default: Megatron's parallel_state). Megatron
        updates parameters in place, so each publish reads them as they are then. Raises
        RegistrationError naming every parameter that does not map; nothing is registered
        then. Returns {HF name: (offsets, sizes)} of what was registered."""
        from .megatron import MegatronSource

        source = MegatronSource(model, config, ranks, skip)
        boxes = self._sources.add_megatron(source, zero_copy=zero_copy)
        self._start.forget_plan(declared=True)
        return boxes

    def release_parameters(self) -> None:
        """Before parameters registered with `register_module` or `register_megatron` move
        (offloaded to the CPU between versions, as verl's `model.to("cpu")`): this rank
        drops every reference it holds to their storage, so moving them frees it. Without
        this call the storage of the last publish stays allocated until the next one. The
        next publish reads them where they are then, and packs as a first version does."""
        self._sources.release()
        self._packer.forget()

    # --- publishing ----------------------------------------------------------

    def plan(self, timeout_s: float | None = None) -> RankPlan:
        """This rank's plan (waits until every rank of the job has registered)."""
        return self._start.plan(timeout_of(timeout_s, self.timeout_s))

    def prepare(self, timeout_s: float | None = None) -> RankPlan:
        """Fetch the plan and register the staging region now, not in the first publish.

        Waits until every rank of the job has registered. The staging memory is touched
        once here, so no version pays for page faults.
        """
        plan = self.plan(timeout_s)
        self._ensure_staging(plan)
        return plan

    def _device(self) -> torch.device:
        return self._sources.device()

    def ring(self, plan: RankPlan | None = None) -> StagingRing:
        """Where this rank packs `plan`'s buckets (default: its current plan): the ring's
        slots (0: the whole send) and the staging memory it takes (`nbytes`)."""
        return self._stage.ring(plan or self.plan())

    @property
    def staging_bytes(self) -> int:
        """Staging memory this rank holds now (0 before `prepare`)."""
        return self._stage.staging_bytes

    def _ensure_staging(self, plan: RankPlan) -> torch.Tensor | None:
        return self._stage.ensure_staging(plan)

    @property
    def delta(self) -> DeltaSender:
        """Delta sync: its mode (settable between versions), shadow, what engines hold."""
        return self._delta

    @property
    def slot_events(self) -> bool:
        """Whether slots are reused on the daemon's CUDA IPC events (see `__init__`); off
        once they cannot be opened in this process."""
        return self._reuse.events

    @slot_events.setter
    def slot_events(self, on: bool) -> None:
        self._reuse.events = on

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> PublishStats:
        """Send this rank's part of `version`; returns once all of it has landed.

        `tensors` replaces registered tensors by name for this call (same dtype and
        shape); by default the registered tensors are read as they are now.
        """
        # A GPU publish runs at the short GIL switch interval from its first request on:
        # the BeginVersion round trip hops between this thread and the connection's loop
        # thread, each hop waiting up to a switch interval (5 ms by default) behind any
        # other Python-busy thread of the rank's process. Restored on every path.
        version = version_of(version)
        if tensors is not None:
            tensors = tensors_of(tensors, f"publish({version})")
        with fast_switching(self._device().type == "cuda"):
            return self._publish(version, tensors)

    def _publish(self, version: int, tensors: Mapping[str, torch.Tensor] | None) -> PublishStats:
        t0 = time.perf_counter()
        current = self._sources.current(tensors)
        # open before BeginVersion: the version may fail at an engine's daemon, and its
        # result come back, before the reply to BeginVersion is read here
        fut, landed = self._pending.open(version)
        try:
            begun = self._start.begin(version, t0, self.timeout_s, self._events_on)
        except BaseException:
            self._pending.close(version)
            raise
        self._pending.begun(version)
        plan, staging, device, out = begun.plan, begun.staging, begun.device, begun.out
        counters = begun.counters
        poster = Poster(self._conn, version)
        what = f"version {version} of trainer rank {self.rank}"
        slots = VersionSlots(
            self._reuse, begun, poster, landed, self._events_on, self.timeout_s, what
        )
        result: PublishResult | None = None
        self._delta.begin(version, plan, staging)
        # this rank's packing stream (made once, never from torch's pool: see `streams`)
        pack_stream = self._pack_streams.get(device) if device.type == "cuda" else None
        try:
            if pack_stream is not None:  # what the training wrote before this call is read
                pack_stream.wait_stream(torch.cuda.current_stream(device))
            # This rank packs on a stream of its own: a GPU wait on a slot counter must never
            # hold another rank's packing (two ranks in one process would share the current
            # stream, while the daemon's copies of one wait on the GPU for the other's packs).
            with torch.cuda.stream(pack_stream):
                try:
                    pack_s, posted = pack_buckets(self, begun, current, slots, landed, poster)
                    if posted:
                        ended = False
                        if counters is None:
                            poster.finish()
                        else:
                            ended = not poster.drain(landed, self.timeout_s, what)
                        if plan.trailers and not ended:
                            assert out is not None
                            lengths = self._delta.trailers(plan, out)
                            self._conn.send(TrailersReady(version=version, lengths=lengths))
                except Exception as exc:
                    poster.abandon()
                    self._delta.abandon()
                    self._abort(version, f"packing failed on trainer rank {self.rank}: {exc!r}")
                    raise
            result = fut.result(self.timeout_s)
        except TimeoutError:
            self._delta.settle(version, plan, None)
            raise TimeoutError_(
                f"version {version} of trainer rank {self.rank} did not land within "
                f"{self.timeout_s:.0f} s"
            ) from None
        finally:
            if pack_stream is not None:  # the caller's later work comes after the packs
                torch.cuda.current_stream(device).wait_stream(pack_stream)
            self._pending.close(version)
            slots.end(result is not None and result.ok, len(plan.buckets))
        self._delta.settle(version, plan, result)
        if not result.ok:
            raise error_from_code(result.code, f"version {version}: {result.message}")
        total_s = time.perf_counter() - t0
        return publish_stats(version, begun, poster, result, pack_s, slots, self._delta, total_s)

    def _events_on(self, device: torch.device, ring: StagingRing) -> bool:
        """Whether to ask for `BucketsIssued`: a ring packed on a GPU, events not given up."""
        return self.slot_events and ring.slots > 0 and device.type == "cuda"

    def _post_bucket(
        self,
        poster: Poster,
        index: int,
        device: torch.device,
        started: float,
        delta: list[tuple[int, int, int]],
        in_place: bool = False,
        queued: bool = False,
    ) -> None:
        poster.post(index, device, started, delta, in_place, queued)

    def _abort(self, version: int, reason: str) -> None:
        """Tell the daemon the version will not be finished (its engines learn it failed);
        best effort: the caller raises the reason itself."""
        with contextlib.suppress(Exception):
            self._conn.request(AbortVersion(version=version, reason=reason), timeout_s=5)

    def _on_notify(self, msg: LocalMessage) -> None:
        self._pending.notify(msg)

    def _on_notify_inline(self, msg: LocalMessage) -> bool:
        """Every trainer notification only updates `PendingVersions` and wakes who waits:
        taken at once, a publish returns (and ring slots come free) a thread hop sooner."""
        self._pending.notify(msg)
        return True

    def _replay(self) -> None:
        """The daemon restarted: register everything again, on a fresh session."""
        self._fail_pending(PeerLostError("the daemon restarted mid-version; publish again"))
        super()._replay()
        self._sources.declare_again()
        self._stage.register_again()
        self._start.forget_plan()
        self._reuse.forget_events()  # the new daemon's events are others

    def _fail_pending(self, exc: Exception) -> None:
        super()._fail_pending(exc)
        self._pending.fail(exc)

    def close(self) -> None:
        super().close()
        self._pending.idle(10.0)  # a publish of another thread ends before its staging goes
        self._stage.close()
        self._source_regions.close()
        if self._direct is not None:
            self._direct.close()
