"""Soak: 200 consecutive versions on the demo topology; daemon RSS and fds stay flat."""

from __future__ import annotations

import re

import pytest

from .test_demo import demo


@pytest.mark.timeout(900)
def test_200_versions_rss_and_fds_flat() -> None:
    stdout = demo(0.03, 200, "--resources", timeout_s=900)
    assert "verified 200 versions" in stdout
    lines = re.findall(
        r"resources (\S+): rss ([\d.]+) MB -> ([\d.]+) MB, open fds (\d+) -> (\d+)", stdout
    )
    assert len(lines) == 2, stdout
    print("\n".join(f"{n}: rss {a} -> {b} MB, fds {c} -> {d}" for n, a, b, c, d in lines))
    for node, rss1, rss2, fd1, fd2 in lines:
        assert int(fd2) <= int(fd1) + 2, f"{node} leaks file descriptors: {fd1} -> {fd2}"
        assert float(rss2) <= float(rss1) * 1.25 + 16, f"{node} RSS grew: {rss1} -> {rss2} MB"
