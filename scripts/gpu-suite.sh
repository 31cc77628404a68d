#!/usr/bin/env bash
# The GPU suite, one command on a GPU machine: the GPU tests, then `weightwire bench gpu`
# (2x2 on >= 4 GPUs, 1x1 on >= 2, each with its trace; the CPU-replica path; FP8 engines if
# time is left). Everything it prints and writes lands in $OUT (the device tool's output
# folder; default results/out), file names carrying the device, e.g.
# 4xNVIDIA-H200-bench-2x2.json. Bounded: the stages share SUITE_BUDGET_S (default 510 s).
# Exits non-zero if a test or a benchmark failed, but always runs every stage it can.
#
# No network there: pyzmq, msgspec and structlog come from the carried .whl/ (git-ignored,
# see results/README.md); weightwire itself is imported from this working tree.
#
# SUITE_TESTS_S caps the GPU tests stage (default 170 s); SUITE_TEST_FILES (space-separated)
# runs only those test files. SUITE_STAGES picks stages (default:
# probe,tests,colocated,2x2,2x2-zero-copy,1x1,replica,fp8; e.g. SUITE_STAGES=2x2; `rings`, not
# in the default, compares staging rings of 2 and 4 slots with the whole send, slots waited
# for on GPU counters and by the daemon's IPC events). `colocated`:
# trainer and engine on GPU 0 (--place 0:0): bf16 through staging (bench-colocated-bf16),
# then packed in place (--direct) with bf16 and FP8 engines (bench-colocated-bf16-direct,
# bench-colocated-fp8-direct); the summary's "busiest link 0->0 at X of its rate" is the
# fraction of the same-GPU copy rate. Before them, `weightwire.bench.packrate` times the
# packing kernels for one bucket ($TAG-packrate.json; its table in the suite log).
# WW_SUITE_CPU=1 runs the same stages without a GPU (tiny model, --device cpu, GPU tests
# skipped): a self-test of this script, never a measurement.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/results/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-510}
START=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
rc=0
declare -a SUMMARY=()

left() { echo $((BUDGET - (SECONDS - START))); }
# cap MAX RESERVE: seconds for a stage, at most MAX, leaving RESERVE for the stages after it
cap() {
    local c=$(($(left) - $2))
    ((c > $1)) && c=$1
    echo "$c"
}
note() { SUMMARY+=("$1"); echo "== $1"; }

# --- the machine --------------------------------------------------------------------
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9._\n-' '-' | tr -d '\n')
TAG="${NGPU}x${NAME:-no-GPU}"
SELFTEST=${WW_SUITE_CPU:-0}
STAGES=",${SUITE_STAGES:-probe,tests,colocated,2x2,2x2-zero-copy,1x1,replica,fp8},"
wanted() { [[ $STAGES == *",$1,"* ]]; }
declare -a EXTRA=()
if ((SELFTEST)); then
    NGPU=4
    TAG=selftest-cpu
    EXTRA=(--device cpu --layers 2 --set hidden_size=256 --set num_attention_heads=2
        --set num_key_value_heads=2 --set head_dim=128 --set num_experts=4
        --set num_experts_per_tok=2 --set moe_intermediate_size=256 --set vocab_size=1000)
fi
LOG="$OUT/$TAG-suite.log"
exec > >(tee -a "$LOG") 2>&1
echo "== weightwire GPU suite $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)'), on $TAG"
{
    nvidia-smi -L
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current --format=csv
    nvidia-smi topo -m
} 2>&1 | tee "$OUT/$TAG-env.txt"
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/$TAG-env.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
      "gpus", torch.cuda.device_count())
EOF
{ df -h /dev/shm; free -g; echo "cpus $(nproc)"; } 2>&1 | tee -a "$OUT/$TAG-env.txt"

# --- python packages: carried wheels, weightwire from this tree ------------------------
SITE=/tmp/ww-site
rm -rf "$SITE" && mkdir -p "$SITE"
WHEELS_DIR=${WHEELS_DIR:-.whl}
WHEELS=()
for w in "$WHEELS_DIR"/*.whl; do
    [[ -e $w && $(basename "$w") != weightwire-* ]] && WHEELS+=("$w")
done
if ((${#WHEELS[@]})); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${WHEELS[@]}" ||
        echo "installing the carried wheels failed (the import check below decides)"
else
    echo "no $WHEELS_DIR/*.whl here: carry .whl (pyzmq, msgspec, structlog wheels for this python)"
fi
# weightwire's subpackages live in top-level folders (pyproject's package-dir); the tests
# put the repository first on sys.path, where weightwire/ holds only __init__.py. A
# meta-path finder, installed at interpreter start (sitecustomize, inherited by the
# daemons and rank processes), maps every package to its folder, as `pip install -e` does.
"$PY" - "$REPO" "$SITE" <<'EOF'
import json, os, sys, tomllib
repo, site = sys.argv[1:3]
with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
mapping = {k: os.path.join(repo, v) for k, v in dirs.items()}
code = f'''"""weightwire from the working tree {repo} (scripts/gpu-suite.sh)."""
import importlib.util as _u, os as _os, sys as _sys
_MAP = {json.dumps(mapping)}

class _WeightwireFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        d = _MAP.get(name)
        if d is None:
            return None
        return _u.spec_from_file_location(
            name, _os.path.join(d, "__init__.py"), submodule_search_locations=[d])

_sys.meta_path.insert(0, _WeightwireFinder)
_here = _os.path.dirname(_os.path.abspath(__file__))
for _p in _sys.path:  # keep any sitecustomize this one shadows
    _f = _os.path.join(_p or ".", "sitecustomize.py")
    if _os.path.abspath(_p or ".") != _here and _os.path.isfile(_f):
        exec(compile(open(_f).read(), _f, "exec"), {{"__name__": "sitecustomize", "__file__": _f}})
        break
'''
with open(os.path.join(site, "sitecustomize.py"), "w") as f:
    f.write(code)
EOF
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import weightwire.transport.cuda, weightwire.bench.gpu.launcher, zmq, msgspec, structlog, uvloop, weightwire; print('weightwire from', weightwire.__file__)"; then
    # fallback: a carried weightwire wheel, imported before anything puts the repo first
    if ls "$WHEELS_DIR"/weightwire-*.whl >/dev/null 2>&1; then
        echo "working-tree import failed; using the carried weightwire wheel"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$WHEELS_DIR"/weightwire-*.whl
        echo 'import weightwire.cli.main  # pinned before the repository comes first on sys.path' >"$SITE/sitecustomize.py"
    fi
    "$PY" -c "import weightwire.transport.cuda, zmq, msgspec, structlog; import weightwire; print('weightwire from', weightwire.__file__)" ||
        { note "FAIL: weightwire does not import; nothing else can run"; exit 1; }
fi

# --- how a third process copies between two GPUs (the cuda transport's case) ------------
if ((NGPU >= 2 && !SELFTEST)) && wanted probe; then
    echo "== cuda p2p probe (copy strategies of the cuda transport, beside torch's peer copy)"
    timeout -k 5 90 "$PY" scripts/cuda_p2p_probe.py 2>&1 | tee "$OUT/$TAG-p2p.json" ||
        note "FAIL: cuda p2p probe"
fi

# --- the GPU tests ---------------------------------------------------------------------
if wanted tests; then
    if [[ -n ${SUITE_TEST_FILES:-} ]]; then  # e.g. SUITE_TEST_FILES=tests/test_memory_saver_gpu.py
        read -ra GPU_TESTS <<<"$SUITE_TEST_FILES"
    else
        mapfile -t GPU_TESTS < <(grep -lE 'mark[.]gpu|import pytestmark' tests/test_*.py)
    fi
    T=${SUITE_TESTS_S:-$(cap 170 240)}
    echo "== pytest -m gpu ${GPU_TESTS[*]} (at most ${T} s)"
    timeout -k 15 "$T" "$PY" -m pytest -m gpu -ra -p no:cacheprovider --timeout 150 \
        --junitxml="$OUT/$TAG-pytest.xml" "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/$TAG-pytest.log"
    prc=${PIPESTATUS[0]}
    if ((prc == 0)); then note "ok: GPU tests"; else note "FAIL: GPU tests (rc $prc)"; rc=1; fi
fi

# --- the benchmark -----------------------------------------------------------------------
# bench NAME MAX RESERVE ARGS...: one `weightwire bench gpu` run with its own JSON, log,
# trace; a --time-budget inside the hard timeout so it always writes its report. The stage
# that SUITE_STAGES names is NAME, or $STAGE when set (several runs of one stage).
bench() {
    local name=$1 max=$2 reserve=$3
    shift 3
    wanted "${STAGE:-$name}" || return 0
    local t
    t=$(cap "$max" "$reserve")
    if ((t < 45)); then
        note "SKIP: bench $name (only $(left) s left)"
        return
    fi
    local work=/tmp/ww-bench-$name
    rm -rf "$work"
    echo "== weightwire bench gpu $* (at most ${t} s)"
    timeout -k 20 "$t" "$PY" -m weightwire.cli bench gpu "$@" "${EXTRA[@]}" --json \
        --workdir "$work" --time-budget $((t - 25)) --timeout $((t - 20)) \
        >"$OUT/$TAG-bench-$name.json" 2>"$OUT/$TAG-bench-$name.log"
    local brc=$?
    cat "$OUT/$TAG-bench-$name.log"
    mkdir -p "$OUT/$TAG-logs-$name"
    find "$work" -name '*.log' -exec cp {} "$OUT/$TAG-logs-$name/" \; 2>/dev/null
    if ((brc == 0)); then note "ok: bench $name"; else note "FAIL: bench $name (rc $brc)"; rc=1; fi
}
if ((NGPU >= 1 && !SELFTEST)) && wanted colocated; then
    # the packing kernels alone, one bucket, against the same-GPU copy rate (every FP8
    # variant checked bitwise): per-bucket and per-launch costs for the runs below
    echo "== packing variants, one bucket (python -m weightwire.bench.packrate)"
    timeout -k 5 120 "$PY" -m weightwire.bench.packrate --json >"$OUT/$TAG-packrate.json" ||
        { note "FAIL: packrate"; rc=1; }
fi
if ((NGPU >= 1)); then
    # colocated: trainer and engine share GPU 0. Through staging and the cuda transport (as
    # before), then --direct: packed straight into the engine's memory (packing is the
    # whole transfer), bf16 and FP8 engines
    STAGE=colocated bench colocated-bf16 120 330 --pairs 1x1 --place 0:0 --versions 3
    STAGE=colocated bench colocated-bf16-direct 120 220 --pairs 1x1 --place 0:0 --direct \
        --versions 3 --trace "$OUT/$TAG-bench-colocated-bf16-direct-trace.json"
    STAGE=colocated bench colocated-fp8-direct 120 120 --pairs 1x1 --place 0:0 --direct \
        --dest fp8 --layers 8 --versions 3
fi
if ((NGPU >= 4)); then
    bench 2x2 200 150 --pairs 2x2 --trace "$OUT/$TAG-bench-2x2-trace.json"
    bench 2x2-zero-copy 150 150 --pairs 2x2 --zero-copy --trace "$OUT/$TAG-bench-2x2-zero-copy-trace.json"
fi
if ((NGPU >= 1)); then
    bench 1x1 180 50 --pairs 1x1 --trace "$OUT/$TAG-bench-1x1-trace.json"
    # opt-in (SUITE_STAGES=rings): the staging ring at 2 and 4 slots against the whole send,
    # 1x1 (colocated on one GPU), each run verified, ratios in the table and JSON; slots
    # waited for on GPU counters with buckets posted before they are packed (the default),
    # then the same posted once packed (`N:packed`: the host in the loop) in the same
    # process. SUITE_RINGS overrides the list (`N:events`: the daemon's IPC events).
    bench rings 480 0 --pairs 1x1 --staging-buckets "${SUITE_RINGS:-0,2,4,8,0:packed,2:packed,4:packed}" \
        --versions 5 --no-baseline
    # the same rings with 1 GiB buckets (the coordinator's bucket_bytes): on one GPU the
    # trainer's packing and the daemon's copies are two processes' contexts, which the GPU
    # time-slices (no MPS); a ring holding >= 2 GiB lets each context run longer at a time
    STAGE=rings bench rings-1g 240 0 --pairs 1x1 --staging-buckets 0,2,4 --versions 5 \
        --daemon-flag bucket-bytes=1073741824 --no-baseline
    bench replica 90 0 --replica --layers 8 --versions 2 --trace "$OUT/$TAG-bench-replica-trace.json"
    if ((NGPU >= 4)); then FP8PAIR=2x2; else FP8PAIR=1x1; fi
    bench fp8 100 0 --pairs $FP8PAIR --dest fp8 --layers 8 --versions 2
else
    note "FAIL: no GPU visible, no benchmark"
    rc=1
fi

# --- the record ----------------------------------------------------------------------------
"$PY" - "$OUT" "$TAG" <<'EOF' | tee "$OUT/$TAG-summary.txt"
import glob, json, os, sys
out, tag = sys.argv[1:3]
for path in sorted(glob.glob(os.path.join(out, f"{tag}-bench-*.json"))):
    if path.endswith("-trace.json"):
        continue
    try:
        r = json.load(open(path))
    except Exception as exc:
        print(f"{os.path.basename(path)}: no report ({exc})")
        continue
    for run in r.get("runs", []):
        head = f"{os.path.basename(path)} {run.get('pair')} ({r.get('device_name')}, dest {r.get('dest')}, {run.get('layers')} layers)"
        if "weightwire_s" not in run:
            print(f"{head}: {run.get('error', 'no result')}".splitlines()[0])
            continue
        line = f"{head}: weightwire {run['weightwire_s']:.3f} s, {run['weightwire_gbps']:.1f} GB/s"
        if "baseline_s" in run:
            line += f"; baseline {run['baseline_s']:.3f} s; speedup {run['speedup']:.2f}x"
        if "link_fraction" in run:
            line += f"; busiest link {run['busiest']['link']} at {run['link_fraction']:.2f} of its rate"
        if "replica_stages" in run:
            line += "; " + ", ".join(f"{k} {v['gbps']:.2f} GB/s" for k, v in run["replica_stages"].items())
        v = run.get("verified", {})
        line += f"; verified ww={v.get('weightwire')} base={v.get('baseline')}"
        print(line)
EOF
# traces and per-run logs compressed, as the records keep them (results/README.md)
find "$OUT" -maxdepth 1 -name "$TAG-*-trace.json" -exec gzip -9nf {} +
for d in "$OUT/$TAG"-logs-*/; do
    [[ -d $d ]] || continue
    tar -C "$OUT" --sort=name -czf "${d%/}.tar.gz" "$(basename "$d")" && rm -r "$d"
done
echo "== suite: $((SECONDS - START)) s, results in $OUT"
for s in "${SUMMARY[@]}"; do echo "   $s"; done
exit $rc
