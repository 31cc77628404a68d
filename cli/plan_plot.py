"""`weightwire plan --plot`: the per-NIC load of a report as a figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan_report import Report


def plot(report: Report, path: str) -> None:
    """Per-NIC load, trainers above and engine GPUs below, on one scale: bars are the bytes
    each NIC carries (left axis, GB; right axis, the same in seconds at its line rate),
    dots are when the simulation had its last byte through, the dashed line is the bound."""
    import numpy as np

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from exc
    s, b, t = report.sim, report.bound, report.topo
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), constrained_layout=True)
    top = max(s.seconds, b.seconds) * 1.3
    for ax, nbytes, finish, label, rate in (
        (axes[0], s.src_bytes, s.src_finish, f"trainer GPU NICs ({t.trainers})", b.trainer_nic_Bps),
        (axes[1], s.dst_bytes, s.dst_finish, f"engine GPU NICs ({t.engines})", b.engine_nic_Bps),
    ):
        gb = rate / 1e9  # GB per second of line rate
        x = np.arange(nbytes.shape[0])
        ax.bar(
            x,
            nbytes / 1e9,
            width=0.9 if x.size < 64 else 1.0,
            color="#4C72B0",
            label="bytes through the NIC",
        )
        ax.plot(
            x,
            finish * gb,
            ".",
            ms=4 if x.size < 200 else 2.5,
            color="#C44E52",
            label="simulated: last byte through",
        )
        ax.axhline(
            b.seconds * gb, color="k", ls="--", lw=1, label=f"busiest-NIC bound {b.seconds:.3f} s"
        )
        ax.axhline(
            s.seconds * gb, color="#C44E52", ls=":", lw=1, label=f"simulated {s.seconds:.3f} s"
        )
        ax.set_xlim(-0.5, x.size - 0.5)
        ax.set_ylim(0, top * gb)
        ax.set_xlabel(label)
        ax.set_ylabel("GB")
        sec = ax.secondary_yaxis("right", functions=(lambda v, g=gb: v / g, lambda v, g=gb: v * g))
        sec.set_ylabel(f"seconds at {t.nic_gbps:g} Gbit/s")
        ax.legend(loc="upper left", ncol=4, fontsize=8, framealpha=0.9)
    fig.suptitle(
        f"{report.model}, {report.dtype}: {t.trainers} trainers -> {t.replicas}x{t.tp} engine "
        f"GPUs, {t.nic_gbps:g} Gbit/s per GPU: simulated {s.seconds:.3f} s, "
        f"bound {b.seconds:.3f} s, efficiency {b.seconds / s.seconds:.3f}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
