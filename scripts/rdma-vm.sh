#!/usr/bin/env bash
# Run a command inside a QEMU VM (virtme-ng, TCG) that has Soft-RoCE devices, in this repository.
#
#   scripts/rdma-vm.sh [--setup-only] [--timeout SECONDS] -- <command...>
#
# Host side (root, Debian 12), idempotent and quiet once done:
#   - Debian packages: qemu, a distro kernel (linux-image-amd64), busybox, rdma-core, pyverbs...
#   - .venv-vm/    virtme-ng (provides `vng`)                      [git-ignored: .venv-*/]
#   - .venv-rdma/  Debian's /usr/bin/python3 (3.11.2) + pyverbs (symlinked from dist-packages)
#                  + this project installed editable with '.[dev]'  [git-ignored: .venv-*/]
# Guest side: modprobe rdma_rxe; rxe0 on `lo` (talks to itself only); rxe1 (10.233.0.1) and
#   rxe2 (10.233.0.2) on the two ends of a veth pair, reaching each other over the veth.
#   PATH starts with .venv-rdma/bin; cwd = repo root (read-write, shared with the host).
#   Exported: WEIGHTWIRE_RDMA_VM=1, WEIGHTWIRE_RDMA_DEVICES="rxe0 rxe1 rxe2" (those that came up),
#   WEIGHTWIRE_RDMA_PAIR="rxe1 rxe2" (two distinct devices that can talk; empty if unavailable).
#
# Exit status: the command's own status; 77 = cannot run here (not root / no packages / no kernel:
#   one line on stderr says why, callers skip); 124 = VM timed out (killed);
#   125 = guest RDMA setup failed; 255 = the VM died without reporting a status (kernel panic,
#   QEMU failure). Note a command that itself exits 255 is indistinguishable from a crash.
#
# Environment: RDMA_VM_TIMEOUT (whole VM incl. boot, default 900 s), RDMA_VM_MEM (default 3G),
#   RDMA_VM_CPUS (default 2), RDMA_VM_VERBOSE=1 (setup chatter and timings on stderr),
#   RDMA_VM_CONSOLE=1 (kernel console on stderr: slower boot, use it to debug a panic),
#   RDMA_VM_FASTFS=0 (no cached read-only view of the Python library dirs; see the guest script),
#   RDMA_VM_TORCH=1 (also install torch==2.13.0 into .venv-rdma), RDMA_VM_RWDIRS (extra
#   space-separated host dirs made writable in the guest; everything else is read-only and /tmp
#   is a guest-private overlay).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VNG_SPEC=${RDMA_VM_VNG_SPEC:-virtme-ng==1.42}
TORCH_SPEC=torch==2.13.0
TIMEOUT=${RDMA_VM_TIMEOUT:-900}
MEM=${RDMA_VM_MEM:-3G}
CPUS=${RDMA_VM_CPUS:-2}
VERBOSE=${RDMA_VM_VERBOSE:-0}
SETUP_ONLY=0

usage() { echo "usage: $0 [--setup-only] [--timeout SECONDS] -- <command...>" >&2; exit 2; }
skip() { echo "rdma-vm: skipped: $*" >&2; exit 77; }
say() { [ "$VERBOSE" = 1 ] && echo "rdma-vm: $*" >&2; return 0; }

while [ $# -gt 0 ]; do
  case "$1" in
    --setup-only) SETUP_ONLY=1; shift ;;
    --timeout) [ $# -ge 2 ] || usage; TIMEOUT=$2; shift 2 ;;
    --timeout=*) TIMEOUT=${1#--timeout=}; shift ;;
    --) shift; break ;;
    -h|--help) awk 'NR>1 && !/^#/ {exit} NR>1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) usage ;;
  esac
done
[ "$SETUP_ONLY" = 1 ] || [ $# -gt 0 ] || usage
case $TIMEOUT in ''|*[!0-9]*) usage ;; esac

[ "$(uname -m)" = x86_64 ] || skip "needs an x86_64 host (have $(uname -m))"
[ "$(id -u)" = 0 ] || skip "needs root (to install packages and load rdma_rxe inside the VM)"
command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1 \
  || skip "needs a Debian-based host (apt-get)"

LOG=$(mktemp /tmp/rdma-vm-setup.XXXXXX.log)
GUEST_DIR=
cleanup() { rm -f "$LOG"; [ -n "$GUEST_DIR" ] && rm -rf "$GUEST_DIR"; return 0; }
trap cleanup EXIT

# Serialize setup between concurrent callers (VM runs themselves may overlap).
LOCKF=/run/lock/weightwire-rdma-vm.lock
[ -d /run/lock ] && [ -w /run/lock ] || LOCKF=/tmp/weightwire-rdma-vm.lock
exec 9>"$LOCKF" || skip "cannot open lock file $LOCKF"
flock -w 1800 9 || skip "timed out waiting for another rdma-vm setup (lock)"

# ---------------------------------------------------------------- Debian packages
PKGS=(qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-providers ibverbs-utils
      python3-pyverbs perftest python3-venv iproute2 kmod util-linux)
missing=()
for p in "${PKGS[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "rdma-vm: installing ${missing[*]} (one-time, ~1 min)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$LOG" 2>&1; then
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
      >>"$LOG" 2>&1 || skip "could not install ${missing[*]} ($(tail -n1 "$LOG"))"
  fi
fi

# The newest installed distro kernel with rdma_rxe (the running kernel may not be a Debian one).
KVER=
for k in $(ls -1 /boot/vmlinuz-* 2>/dev/null | sed 's|/boot/vmlinuz-||' | sort -rV); do
  if [ -n "$(find "/lib/modules/$k" -name 'rdma_rxe.ko*' -print -quit 2>/dev/null)" ]; then
    KVER=$k; break
  fi
done
[ -n "$KVER" ] || skip "no kernel with rdma_rxe under /boot (apt-get install linux-image-amd64)"
KERNEL=/boot/vmlinuz-$KVER
[ -r "$KERNEL" ] || skip "$KERNEL is not readable"

# ---------------------------------------------------------------- .venv-vm (virtme-ng)
VMV=$REPO/.venv-vm
if [ "$(cat "$VMV/.installed" 2>/dev/null)" != "$VNG_SPEC" ] || [ ! -x "$VMV/bin/vng" ]; then
  echo "rdma-vm: installing $VNG_SPEC into .venv-vm" >&2
  { rm -rf "$VMV" && /usr/bin/python3 -m venv "$VMV" \
      && "$VMV/bin/python" -m pip install -q --disable-pip-version-check "$VNG_SPEC"; } \
    >"$LOG" 2>&1 || skip "could not install $VNG_SPEC into .venv-vm ($(tail -n1 "$LOG"))"
  echo "$VNG_SPEC" >"$VMV/.installed"
fi

# ---------------------------------------------------------------- .venv-rdma (test interpreter)
# Debian's python3 is the only one with pyverbs (python3-pyverbs, built for 3.11.2). The venv is
# isolated from the rest of Debian's dist-packages; only the pyverbs package is symlinked in.
RV=$REPO/.venv-rdma
want=$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)
if [ "$(cat "$RV/.installed" 2>/dev/null)" != "$want" ] || [ ! -x "$RV/bin/python" ] \
   || ! "$RV/bin/python" -c 'import pyverbs.device, weightwire' >/dev/null 2>&1; then
  echo "rdma-vm: building .venv-rdma (Debian python3 + pyverbs + project '.[dev]')" >&2
  [ -x "$RV/bin/python" ] || /usr/bin/python3 -m venv "$RV" >"$LOG" 2>&1 \
    || skip "could not create .venv-rdma ($(tail -n1 "$LOG"))"
  site=$("$RV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ln -sfn /usr/lib/python3/dist-packages/pyverbs "$site/pyverbs"
  { "$RV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip \
      && "$RV/bin/python" -m pip install -q --disable-pip-version-check -e "${REPO}[dev]"; } \
    >"$LOG" 2>&1 || skip "could not install the project into .venv-rdma ($(tail -n1 "$LOG"))"
  "$RV/bin/python" -c 'import pyverbs.device, weightwire' >"$LOG" 2>&1 \
    || skip ".venv-rdma cannot import pyverbs/weightwire ($(tail -n1 "$LOG"))"
  echo "$want" >"$RV/.installed"
fi
# torch is opt-in (and sticky once installed): `import torch` alone takes ~45-150 s in the VM.
if [ "${RDMA_VM_TORCH:-0}" = 1 ] && [ ! -d "$("$RV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" ]; then
  echo "rdma-vm: installing $TORCH_SPEC into .venv-rdma" >&2
  "$RV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" >"$LOG" 2>&1 \
    || skip "could not install $TORCH_SPEC into .venv-rdma ($(tail -n1 "$LOG"))"
fi

flock -u 9
exec 9>&-
say "setup ok: kernel $KERNEL, $("$VMV/bin/vng" --version 2>/dev/null | head -n1)"
[ "$SETUP_ONLY" = 1 ] && exit 0

# ---------------------------------------------------------------- guest script
# Written on the host before boot: the guest sees the host's / read-only (9p), /tmp as an overlay.
GUEST_DIR=$(mktemp -d /tmp/rdma-vm.XXXXXX)
{
  echo '#!/bin/bash'
  echo "REPO=$(printf '%q' "$REPO"); VERBOSE=$VERBOSE; FASTFS=${RDMA_VM_FASTFS:-1}"
  cat <<'EOF'
t_boot=$(cut -d' ' -f1 /proc/uptime)
fail() { echo "rdma-vm(guest): RDMA setup failed: $*" >&2; exit 125; }
log() { [ "$VERBOSE" = 1 ] && echo "rdma-vm(guest): $*" >&2; return 0; }
lap() { log "$(cut -d' ' -f1 /proc/uptime)s: $*"; }
ip link set lo up
modprobe rdma_rxe || fail "modprobe rdma_rxe"
lap "rdma_rxe loaded"
rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0 netdev lo"
lap "rxe0 added"
devs=rxe0 pair=
# Two more devices that can reach EACH OTHER: rxe1/rxe2 on the two ends of a veth pair
# (10.233.0.1 <-> 10.233.0.2). Both addresses are local, so by default the kernel would loop the
# packets through `lo` and rxe would hand them to rxe0 (it demultiplexes by the receiving netdev);
# policy routing sends locally generated traffic for the peer address out of the veth instead, and
# the local table (moved from rule 0 to 20) still accepts it on arrival.
# (Batched: every process start costs ~0.3 s in this VM.)
sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.default.accept_local=1 \
  net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 2>/dev/null
if ip -batch - 2>/dev/null <<'IPS' && rdma link add rxe1 type rxe netdev ww-va \
   && rdma link add rxe2 type rxe netdev ww-vb; then
link add ww-va mtu 9000 type veth peer name ww-vb mtu 9000
address add 10.233.0.1/24 dev ww-va
address add 10.233.0.2/24 dev ww-vb
link set ww-va up
link set ww-vb up
rule add pref 10 iif lo to 10.233.0.2 lookup 233
rule add pref 11 iif lo to 10.233.0.1 lookup 234
route add 10.233.0.2 dev ww-va src 10.233.0.1 table 233
route add 10.233.0.1 dev ww-vb src 10.233.0.2 table 234
rule add pref 20 lookup local
rule del pref 0
IPS
  devs="$devs rxe1 rxe2" pair="rxe1 rxe2"
else
  log "rxe1/rxe2 on a veth pair not available"
fi
lap "veth pair: $pair"
for d in $devs; do
  for _ in $(seq 100); do
    grep -q ACTIVE "/sys/class/infiniband/$d/ports/1/state" 2>/dev/null && break
    sleep 0.1
  done
  grep -q ACTIVE "/sys/class/infiniband/$d/ports/1/state" || fail "$d port not ACTIVE"
done
log "kernel $(uname -r); boot to command ${t_boot}s; rdma ready at $(cut -d' ' -f1 /proc/uptime)s; devices: $devs"
lap "ports active"
# Python's files over the default uncached 9p root cost most of the guest's time (import torch:
# ~150 s -> ~45 s). A second, read-only 9p export of / (tag wwro) mounted with cache=loose is
# bind-mounted over the interpreter's and .venv-rdma's library dirs: read-only content that does
# not change during a run. The repository itself stays on the coherent read-write share.
if [ "$FASTFS" = 1 ]; then
  if mkdir -p /run/ww-ro && mount -t 9p -o ro,trans=virtio,version=9p2000.L,access=any,msize=524288,cache=loose wwro /run/ww-ro 2>/dev/null; then
    for d in /usr/lib/python3.11 /usr/lib/python3 "$REPO/.venv-rdma/lib"; do
      [ -d "/run/ww-ro$d" ] && mount --bind "/run/ww-ro$d" "$d" || log "no cached view of $d"
    done
  else
    log "cached read-only 9p view not available (slower imports)"
  fi
fi
export WEIGHTWIRE_RDMA_VM=1 WEIGHTWIRE_RDMA_DEVICES="$devs" WEIGHTWIRE_RDMA_PAIR="$pair"
# a daemon starts in seconds on the host, far slower in this emulated VM on a loaded machine
export WEIGHTWIRE_TEST_DAEMON_READY_S="${WEIGHTWIRE_TEST_DAEMON_READY_S:-120}"
export VIRTUAL_ENV="$REPO/.venv-rdma" PATH="$REPO/.venv-rdma/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
unset PYTHONHOME PYTHONPATH
cd "$REPO" || fail "cd $REPO"
EOF
  printf 'exec'
  printf ' %q' "$@"
  printf '\n'
} >"$GUEST_DIR/guest.sh"
chmod +x "$GUEST_DIR/guest.sh"

rwargs=(--rwdir "$REPO")
for d in ${RDMA_VM_RWDIRS:-}; do rwargs+=(--rwdir "$d"); done
vargs=(--disable-microvm)
[ "${RDMA_VM_CONSOLE:-0}" = 1 ] && vargs+=(--verbose)
[ "${RDMA_VM_FASTFS:-1}" = 1 ] && vargs+=(--qemu-opts="-fsdev local,id=wwro,path=/,security_model=none,readonly=on,multidevs=remap -device virtio-9p-pci,fsdev=wwro,mount_tag=wwro")

# QEMU reopens /proc/self/fd/1 and /2 as "file" chardevs (a regular file would be truncated and
# written from offset 0) and sets O_NONBLOCK on stdio: give it pipes to private `cat`s instead.
exec 8> >(cat >&2)
errcat=$!
t0=$(date +%s%N)
PATH="$VMV/bin:$PATH" timeout -k 10 "$TIMEOUT" \
  vng --disable-kvm --force-9p --run "$KERNEL" --user root -m "$MEM" --cpus "$CPUS" \
      "${rwargs[@]}" "${vargs[@]}" --cwd "$REPO" --exec "bash $GUEST_DIR/guest.sh" \
      </dev/null 2>&8 | cat
rc=${PIPESTATUS[0]}
exec 8>&-
wait "$errcat" 2>/dev/null
case $rc in
  124|137) echo "rdma-vm: VM killed after the ${TIMEOUT}s timeout (RDMA_VM_TIMEOUT / --timeout)" >&2 ;;
  255) echo "rdma-vm: VM exited without a status (255: kernel panic/QEMU failure, or the command exited 255); rerun with RDMA_VM_CONSOLE=1 to see the kernel console" >&2 ;;
esac
say "VM wall time $(( ($(date +%s%N) - t0) / 1000000 )) ms, exit $rc"
exit "$rc"
