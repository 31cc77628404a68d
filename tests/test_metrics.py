"""The Prometheus endpoint (`metrics_bind`) scraped from real daemons during and after a
version, and the canonical per-job version log line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, serve
from .test_e2e import Proc, bitwise, engine_for, expected_rows

SCRAPE = (
    "import sys, urllib.request; "
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())"
)


def scrape(cluster: LocalCluster, host: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of host `host`'s endpoint, fetched from inside its namespace."""
    url = str(cluster.daemons[host].ready["metrics"])
    text = subprocess.run(
        [*cluster.prefix(host), sys.executable, "-c", SCRAPE, url],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def mcluster() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra=FAST, metrics=True))


def test_metrics_move_during_and_after_a_version(mcluster: LocalCluster) -> None:
    c = mcluster
    job = "metrics"
    eng, mine = engine_for(c, job)
    sock = c.daemons[0].socket
    fast = Proc(c, 0, "--socket", sock, "--rank", "0", "--world", "2", "--job", job)
    slow = Proc(c, 0, "--socket", sock, "--rank", "1", "--world", "2", "--job", job, "--delay", "3")
    try:
        fast.wait_for("ready")
        slow.wait_for("ready")
        before = scrape(c, 0)
        assert value(before, "weightwire_live_peers") == 1
        assert value(before, "weightwire_regions") >= 1  # the trainers' staging
        assert (
            value(before, "weightwire_versions_total", job=job, role="trainer", outcome="ok") == 0
        )

        fast.publish(1)
        slow.publish(1)
        fast.wait_for("done", version=1)
        # mid-version: rank 0's buckets landed and its version finished; rank 1 not begun
        during, during1 = scrape(c, 0), scrape(c, 1)
        ok = {"job": job, "role": "trainer", "outcome": "ok"}
        assert value(during, "weightwire_versions_total", **ok) == 1
        assert value(during, "weightwire_bucket_post_seconds_count", job=job) >= 1
        half = value(during, "weightwire_peer_sent_bytes_total", job=job, peer="host1")
        assert half > 0
        assert (
            value(during1, "weightwire_versions_total", job=job, role="engine", outcome="ok") == 0
        )

        info = eng.wait(1, timeout_s=60)
        for n, t in mine.items():
            assert bitwise(t, expected_rows(1)[n])
        slow.wait_for("done", version=1)
        after, after1 = scrape(c, 0), scrape(c, 1)
        assert value(after, "weightwire_versions_total", **ok) == 2
        total = value(after, "weightwire_peer_sent_bytes_total", job=job, peer="host1")
        assert total == info.nbytes > half
        assert value(after, "weightwire_version_bytes_sum", job=job, role="trainer") == total
        assert (
            value(after, "weightwire_peer_throughput_bytes_per_second_count", job=job, peer="host1")
            == 2
        )
        eng_ok = {"job": job, "role": "engine", "outcome": "ok"}
        assert value(after1, "weightwire_versions_total", **eng_ok) == 1
        assert value(after1, "weightwire_version_bytes_sum", job=job, role="engine") == info.nbytes
        assert value(after1, "weightwire_version_seconds_count", job=job, role="engine") == 1
        assert value(after1, "weightwire_regions") >= 1  # the engine's weights
        assert value(after1, "weightwire_live_peers") == 1
        assert fast.finish() == 0 and slow.finish() == 0
    finally:
        for p in (fast, slow):
            p.kill()
        eng.close()
    # one canonical line per job per version on each daemon
    for d, role_bytes in ((c.daemons[0], "bytes_sent"), (c.daemons[1], "bytes_received")):
        lines = [e for e in d.logs() if e.get("event") == "version" and e.get("job") == job]
        assert len(lines) == 1, lines
        line = lines[0]
        assert line["outcome"] == "ok" and line["version"] == 1
        assert line[role_bytes] == info.nbytes and line["gbyte_s"] > 0
        assert line["peers"] == (["host1"] if d is c.daemons[0] else ["host0"])


def test_failures_counted_by_code() -> None:
    from weightwire.daemon.metrics import Prometheus

    p = Prometheus("n", live_peers=lambda: 3, regions=lambda: 2)
    p.rank_version("j", "engine", 0, 5, 0, 1.0, {"a": 0}, "peer_lost")
    p.rank_version("j", "engine", 1, 5, 0, 1.0, {"a": 0}, "peer_lost")
    p.rank_version("j", "trainer", 0, 5, 10, 1.0, {"a": 10}, None)
    got = p.registry.get_sample_value
    assert (
        got("weightwire_failures_total", {"job": "j", "role": "engine", "code": "peer_lost"}) == 2
    )
    assert (
        got("weightwire_versions_total", {"job": "j", "role": "engine", "outcome": "failed"}) == 2
    )
    assert got("weightwire_live_peers") == 3 and got("weightwire_regions") == 2


def test_metrics_bind_without_prometheus_client_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # an interpreter where prometheus_client cannot be imported
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from weightwire.daemon.main import main\n"
        "sys.exit(main(['--is-coordinator', '--insecure', '--metrics-bind', '127.0.0.1:0',"
        f" '--local-socket', '{tmp_path}/s', '--peer-bind', 'tcp://127.0.0.1:0',"
        f" '--region-dir', '{tmp_path}']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "pip install 'weightwire[metrics]'" in r.stdout + r.stderr


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("Threads:")[1].split()[0])


def test_stalled_scrapers_hold_no_thread_for_long(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """100 connections to the metrics port each send half a request line and stall. They
    held a thread each, for ever (prometheus-client's server: a thread per connection, no
    timeout), so anyone who reaches the port could run the daemon out of threads. Now a
    few are served at once and each is closed after a timeout; a real scrape then works."""
    import socket
    import time
    import urllib.request

    from weightwire.daemon.metrics import HTTP_CONNECTIONS, HTTP_TIMEOUT_S

    c = LocalCluster(hosts=1, extra=FAST, metrics=True, workdir=tmp_path)
    c.start()
    try:
        d = c.daemons[0]
        url = str(d.ready["metrics"])
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        base = _threads(d.proc.pid)
        stalled = []
        for _ in range(100):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            stalled.append(s)
        time.sleep(1.0)
        assert _threads(d.proc.pid) <= base + HTTP_CONNECTIONS + 2, (base, _threads(d.proc.pid))
        deadline = time.monotonic() + HTTP_TIMEOUT_S + 5
        for s in stalled:  # every one closed by the daemon: refused at once, or timed out
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "weightwire_daemon_info" in text
        assert _threads(d.proc.pid) <= base + 2
    finally:
        assert c.stop() == [0]


def test_scrapers_get_in_past_clients_trickling_their_requests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """More clients than the endpoint serves at once each send a request line, then one
    header byte a second: never silent for HTTP_TIMEOUT_S, they kept every slot (each new
    connection closed unanswered), so no scrape got through. Now a request must be whole
    within HTTP_TIMEOUT_S and a new connection takes the slot of the oldest still sending
    its request: scrapes made while they trickle are answered."""
    import socket
    import threading
    import time
    import urllib.request

    from weightwire.daemon.metrics import HTTP_CONNECTIONS, HTTP_TIMEOUT_S

    c = LocalCluster(hosts=1, extra=FAST, metrics=True, workdir=tmp_path)
    c.start()
    stop = threading.Event()
    held: list[float] = []

    def trickle(host: str, port: int) -> None:
        s = socket.create_connection((host, port), timeout=30)
        t0 = time.monotonic()
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            while not stop.is_set():
                s.sendall(b"X")
                time.sleep(1.0)
        except OSError:
            held.append(time.monotonic() - t0)
        finally:
            s.close()

    try:
        url = str(c.daemons[0].ready["metrics"])
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        base = _threads(c.daemons[0].proc.pid)
        clients = [
            threading.Thread(target=trickle, args=(host, int(port)), daemon=True)
            for _ in range(HTTP_CONNECTIONS + 2)
        ]
        for t in clients:
            t.start()
        time.sleep(2.0)  # every slot taken by a trickling client
        for _ in range(3):
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "weightwire_daemon_info" in text
        assert _threads(c.daemons[0].proc.pid) <= base + HTTP_CONNECTIONS + 2
        time.sleep(HTTP_TIMEOUT_S + 2)
        assert len(held) == len(clients), held  # each closed, evicted or at the deadline
        assert max(held) < HTTP_TIMEOUT_S + 3, held
    finally:
        stop.set()
        assert c.stop() == [0]
