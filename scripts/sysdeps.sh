#!/usr/bin/env bash
# Installs the Debian packages the test suite uses, when we are root and they are missing.
# Never fails the build: tests that need a missing tool skip and say why.
set -u
want=(iperf3 iproute2)
missing=()
for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "sysdeps: not root; not installing ${missing[*]} (tests that need them will skip)"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
  apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1
} || echo "sysdeps: could not install ${missing[*]} (tests that need them will skip)"
exit 0
