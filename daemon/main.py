"""`weightwired`: the node daemon's entry point."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog
import uvloop

from weightwire.protocol.errors import WeightwireError

from . import config as config_mod
from . import fdguard, logs
from .flags import add_flags

GIL_SWITCH_S = 0.0005


def parser() -> argparse.ArgumentParser:
    import weightwire

    p = argparse.ArgumentParser(
        prog="weightwired",
        description="weightwire node daemon (one per GPU host). Every setting of the TOML "
        "file is also a flag; flags override the file.",
        allow_abbrev=False,  # `--version` must never be read as `--version-timeout-s`
    )
    p.add_argument("--version", action="version", version=f"weightwired {weightwire.__version__}")
    p.add_argument("--config", "-c", help=f"TOML file (default {config_mod.DEFAULT_CONFIG})")
    add_flags(p)
    return p


def parse(argv: list[str] | None) -> config_mod.DaemonConfig:
    args = vars(parser().parse_args(argv))
    path = args.pop("config")
    return config_mod.load(path, args)


async def serve(cfg: config_mod.DaemonConfig) -> None:
    from .node import Daemon

    daemon = Daemon(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_keys)
    await daemon.run()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(argv)
    except WeightwireError as exc:
        print(f"weightwired: {exc.message}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_level)
    log = structlog.get_logger("weightwire.daemon")
    # The transports' completion threads hand finished copies to the loop; while the loop
    # is busy they wait for the GIL up to a switch interval (5 ms by default), and the
    # copy engines wait with them. 0.5 ms keeps that wait below a bucket's copy time.
    sys.setswitchinterval(GIL_SWITCH_S)
    fdguard.raise_soft_limit()  # as systemd's LimitNOFILE: ranks, peers, regions hold fds
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(cfg))
    except WeightwireError as exc:
        log.error("daemon failed", code=exc.code.value, error=exc.message)
        return 1
    except OSError as exc:
        log.error("daemon failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
