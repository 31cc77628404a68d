"""`weightwire`: the command line (demo, status, bench, plan, keygen, pubkey)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.local import SOCKET_ENV, SOCKET_PATH

DEFAULT_SOCKET = os.environ.get(SOCKET_ENV, SOCKET_PATH)


def build_parser() -> argparse.ArgumentParser:
    import weightwire

    p = argparse.ArgumentParser(prog="weightwire", description=__doc__, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"weightwire {weightwire.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    demo = sub.add_parser(
        "demo", allow_abbrev=False, help="a verified weight sync on a local cluster"
    )
    demo.add_argument("--daemons", type=int, default=2, help="daemons (hosts) to start")
    demo.add_argument("--trainers", type=int, default=2, help="trainer ranks (FSDP shards)")
    demo.add_argument("--engines", type=int, default=2, help="engine ranks (TP shards)")
    demo.add_argument("--model-gb", type=float, default=1.2, help="size of the synthetic model")
    demo.add_argument("--versions", type=int, default=3, help="versions to publish")
    demo.add_argument(
        "--delta",
        choices=["auto", "on", "off"],
        default="auto",
        help="sparse delta sync after the first (dense) version; off: every version dense",
    )
    demo.add_argument(
        "--delta-density", type=float, default=0.02, help="fraction of elements each step changes"
    )
    demo.add_argument(
        "--resources", action="store_true", help="daemon RSS and open fds, first vs last version"
    )
    demo.add_argument(
        "--netns",
        choices=["auto", "on", "off"],
        default="off",
        help="daemons in network namespaces over veth (needs root)",
    )

    st = sub.add_parser(
        "status", allow_abbrev=False, help="a running daemon's regions, peers and progress"
    )
    st.add_argument("--socket", default=DEFAULT_SOCKET, help="the daemon's local_socket")
    st.add_argument("--json", action="store_true", help="the status document as JSON")
    st.add_argument(
        "--cluster",
        action="store_true",
        help="every daemon of the cluster, its jobs and the current version's progress "
        "(asked through this node's daemon)",
    )

    bench = sub.add_parser(
        "bench", allow_abbrev=False, help="benchmarks against a baseline from the same run"
    )
    bsub = bench.add_subparsers(dest="bench", required=True)
    btcp = bsub.add_parser(
        "tcp", allow_abbrev=False, help="daemon-to-daemon tcp vs iperf3 over veth"
    )
    btcp.add_argument("--json", action="store_true", help="the report as JSON")
    btcp.add_argument("--streams", type=int, default=4, help="tcp streams, both tools")
    btcp.add_argument(
        "--gb", type=float, default=1.0, help="bytes per measured round (each setting holds 3x)"
    )
    btcp.add_argument("--seconds", type=float, default=3.0, help="iperf3 duration per round")
    btcp.add_argument("--rounds", type=int, default=3, help="measured rounds of each tool")
    btcp.add_argument(
        "--modes", default="off,auth,encrypt", help="tcp_security settings to measure, in order"
    )
    bdelta = bsub.add_parser(
        "delta", allow_abbrev=False, help="sparse delta sync vs dense, AdamW-trained (CPU)"
    )
    from weightwire.bench.delta import add_arguments as delta_arguments

    delta_arguments(bdelta)
    bbuckets = bsub.add_parser(
        "buckets", allow_abbrev=False, help="the daemon's cost per version and per bucket (CPU)"
    )
    from weightwire.bench.buckets import add_arguments as buckets_arguments

    buckets_arguments(bbuckets)
    brpc = bsub.add_parser(
        "rpc", allow_abbrev=False, help="a local request's round trip vs raw pyzmq (CPU)"
    )
    from weightwire.bench.rpc import add_arguments as rpc_arguments

    rpc_arguments(brpc)
    bgpu = bsub.add_parser(
        "gpu", allow_abbrev=False, help="GPU sync vs the NCCL broadcast baseline (GPU machine)"
    )
    from weightwire.bench.gpu.cli import add_arguments as gpu_arguments

    gpu_arguments(bgpu)

    kg = sub.add_parser(
        "keygen",
        allow_abbrev=False,
        help="a CURVE key pair for a daemon (NAME.key, NAME.key_secret)",
    )
    kg.add_argument("--dir", default="/etc/weightwire", help="where to write the pair")
    kg.add_argument("--name", default=os.uname().nodename, help="file names (default: host name)")
    kg.add_argument(
        "--force", action="store_true", help="replace an existing pair (peers must be told)"
    )

    pk = sub.add_parser(
        "pubkey",
        allow_abbrev=False,
        help="the z85 public key of a key file (for coordinator_public_key)",
    )
    pk.add_argument("file", help="NAME.key or NAME.key_secret (weightwire keygen)")

    pl = sub.add_parser(
        "plan", allow_abbrev=False, help="a sync's bytes per NIC, busiest-NIC bound, simulated time"
    )
    from .plan import add_arguments as plan_arguments

    plan_arguments(pl)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        match args.cmd:
            case "demo":
                from .demo import run

                return run(args)
            case "status":
                from weightwire.client.status import fetch

                from .status import render, render_cluster

                s = fetch(args.socket, cluster=args.cluster)
                text = render_cluster(s) if args.cluster else render(s)
                print(json.dumps(s, indent=2) if args.json else text)
                return 0
            case "keygen":
                import zmq.auth

                from weightwire.daemon.security import keygen

                for suffix in (".key", ".key_secret"):
                    existing = os.path.join(args.dir, args.name + suffix)
                    if os.path.exists(existing) and not args.force:
                        print(
                            f"weightwire keygen: {existing} exists; not replacing this node's "
                            f"key pair (peers trust its public key). --force replaces it",
                            file=sys.stderr,
                        )
                        return 1
                public, secret = keygen(args.dir, args.name)
                key, _ = zmq.auth.load_certificate(str(public))
                print(f"public key  {public}  (give it to every peer's curve_allowed_keys_dir)")
                print(f"secret key  {secret}  (curve_secret_key_file; keep it, mode 0600)")
                print(f"z85 public  {key.decode()}")
                return 0
            case "pubkey":
                import zmq.auth

                from weightwire.daemon.security import missing_key_file

                if missing := missing_key_file(args.file):
                    print(f"weightwire pubkey: {missing}", file=sys.stderr)
                    return 1
                try:
                    key, _ = zmq.auth.load_certificate(args.file)
                except (OSError, ValueError) as exc:
                    print(f"weightwire pubkey: {args.file}: {exc}", file=sys.stderr)
                    return 1
                print(key.decode())
                return 0
            case "plan":
                from .plan import run as run_plan

                return run_plan(args)
            case "bench":
                if args.bench == "gpu":
                    from weightwire.bench.gpu import run as run_gpu

                    return run_gpu(args)
                if args.bench == "buckets":
                    from weightwire.bench.buckets import run as run_buckets

                    return run_buckets(args)
                if args.bench == "rpc":
                    from weightwire.bench.rpc import run as run_rpc

                    return run_rpc(args)
                if args.bench == "delta":
                    from weightwire.bench.delta import run as run_delta

                    return run_delta(args)
                from weightwire.bench.tcp import run as run_tcp

                return run_tcp(args)
    except WeightwireError as exc:
        print(f"weightwire: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
