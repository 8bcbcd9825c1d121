#!/usr/bin/env bash
# Builds the baseline virtual environments that Quiver's benchmarks compare against, under
# .bench-env/, from package registries only (PyPI, Debian). Run through `make bench-env`; never
# part of `make test`, `make demo` or CI.
#
#   .bench-env/pyg    torch==<main .venv's torch>, this package (editable), and torch-sparse 0.6.18
#                     with torch-scatter 2.1.2 (which it imports), both built from their sdists
#                     against that torch: PyG's fast CPU sampler backend
#   .bench-env/dgl    torch==2.2.1 and dgl==2.1.0 (DGL's own pins; deliberately not our torch)
#   .bench-env/wheels the cached source-built wheels, keyed by the torch they were built against
#   .bench-env/logs   full pip output of each step
#
# Usage: bench/baselines/build_envs.sh [pyg|dgl|all]     (default: all)
# Idempotent: an env whose .ready stamp matches this script's inputs is left alone; delete the
# stamp (or the env) to rebuild it. Each env is smoke-tested (verify_*.py) before it is stamped.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/../.."

ROOT=.bench-env
MAIN_PY=.venv/bin/python
HERE=bench/baselines
LOGS=$ROOT/logs
TORCH_SPARSE_VERSION=0.6.18
TORCH_SCATTER_VERSION=2.1.2
DGL_TORCH_VERSION=2.2.1
DGL_VERSION=2.1.0
TORCHDATA_VERSION=0.7.1

# On stderr, so that functions can return values on stdout.
log() { printf '[bench-env %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# run_logged LOGFILE CMD...: appends CMD's output to LOGFILE; on failure shows its tail.
run_logged() {
    local logfile=$1
    shift
    echo "+ $*" >>"$logfile"
    if ! "$@" >>"$logfile" 2>&1; then
        log "FAILED: $*"
        log "last lines of $logfile:"
        tail -n 40 "$logfile" >&2
        exit 1
    fi
}

# fingerprint FILE...: one hash over the files that decide what an env contains.
fingerprint() { cat "$@" | sha256sum | cut -c1-16; }

# is_current ENV FP: true when ENV has a python and its stamp holds FP.
is_current() {
    [[ -x $ROOT/$1/bin/python && -f $ROOT/$1/.ready && "$(cat "$ROOT/$1/.ready")" == "$2" ]]
}

# The base interpreter of the main .venv: the torch-sparse wheel is built by that Python
# (same CPython ABI tag), so the pyg env must be made from the same one.
base_python() { "$MAIN_PY" -c 'import sys; print(sys._base_executable)'; }

new_venv() {
    local env=$1
    if [[ ! -x $ROOT/$env/bin/python ]]; then
        log "$env: creating venv with $(base_python)"
        "$(base_python)" -m venv "$ROOT/$env"
        run_logged "$LOGS/$env.log" "$ROOT/$env/bin/python" -m pip install --upgrade pip wheel
    fi
}

# source_wheel DIST VERSION WHEEL_DIR: prints the path of DIST's wheel in WHEEL_DIR, first
# building it from its sdist with the main .venv's python (and so against its torch) if absent.
source_wheel() {
    local dist=$1 version=$2 wheel_dir=$3 wheel
    local prefix=${dist//-/_}-$version
    mkdir -p "$wheel_dir" "$ROOT/sdist"
    wheel=$(ls "$wheel_dir/$prefix"-*.whl 2>/dev/null | head -n 1 || true)
    if [[ -n $wheel ]]; then
        log "pyg: using cached $wheel"
        echo "$wheel"
        return
    fi
    log "pyg: downloading the $dist $version sdist"
    # --no-build-isolation: pip prepares the sdist's metadata, and its setup.py imports torch.
    run_logged "$LOGS/pyg.log" "$MAIN_PY" -m pip download --no-deps --no-binary :all: \
        --no-build-isolation -d "$ROOT/sdist" "$dist==$version"
    log "pyg: compiling $dist against $("$MAIN_PY" -c 'import torch; print(torch.__version__)')" \
        "(torch-sparse: 13 min on 2 idle cores, 40 min on busy ones; log: $LOGS/pyg.log)"
    # nice: the cores are shared with whoever else works on this machine.
    FORCE_ONLY_CPU=1 run_logged "$LOGS/pyg.log" nice -n 19 "$MAIN_PY" -m pip wheel --no-deps \
        --no-build-isolation -w "$wheel_dir" "$ROOT/sdist/$prefix.tar.gz"
    wheel=$(ls "$wheel_dir/$prefix"-*.whl | head -n 1)
    log "pyg: built $wheel"
    echo "$wheel"
}

build_pyg() {
    local torch_version fp wheel_dir scatter_wheel sparse_wheel start
    [[ -x $MAIN_PY ]] || { log "no $MAIN_PY: run 'make venv' first"; exit 1; }
    torch_version=$("$MAIN_PY" -c 'import torch; print(torch.__version__)')
    fp=$(fingerprint "$HERE/build_envs.sh" constraints.txt pyproject.toml "$HERE/verify_pyg.py"; echo "$torch_version")
    fp=$(echo "$fp" | sha256sum | cut -c1-16)
    if is_current pyg "$fp"; then
        log "pyg: up to date ($ROOT/pyg)"
        return
    fi
    start=$(date +%s)
    : >"$LOGS/pyg.log"

    # The wheels are only ABI-compatible with the exact torch they were compiled against.
    wheel_dir=$ROOT/wheels/torch-$torch_version
    # torch-sparse imports torch-scatter at load time (without declaring it), so both are built.
    scatter_wheel=$(source_wheel torch-scatter "$TORCH_SCATTER_VERSION" "$wheel_dir")
    sparse_wheel=$(source_wheel torch-sparse "$TORCH_SPARSE_VERSION" "$wheel_dir")

    new_venv pyg
    log "pyg: installing torch==${torch_version%%+*}, this package, torch-scatter and torch-sparse"
    run_logged "$LOGS/pyg.log" "$ROOT/pyg/bin/python" -m pip install -c constraints.txt \
        "torch==${torch_version%%+*}"
    # serve extra: the serving benchmarks run their PyG baseline behind the same HTTP front end.
    run_logged "$LOGS/pyg.log" "$ROOT/pyg/bin/python" -m pip install -c constraints.txt \
        -e '.[serve]' "$scatter_wheel" "$sparse_wheel"

    log "pyg: verifying NeighborLoader on the torch-sparse backend"
    "$ROOT/pyg/bin/python" "$HERE/verify_pyg.py"
    echo "$fp" >"$ROOT/pyg/.ready"
    log "pyg: ready in $(($(date +%s) - start)) s"
}

build_dgl() {
    local fp start resolved
    fp=$(fingerprint "$HERE/build_envs.sh" "$HERE/verify_dgl.py")
    if is_current dgl "$fp"; then
        log "dgl: up to date ($ROOT/dgl)"
        return
    fi
    start=$(date +%s)
    : >"$LOGS/dgl.log"
    new_venv dgl
    # No constraints file here: this env is meant to hold DGL's torch, not ours. (The machine-wide
    # pip constraint torch<=2.14.1 still applies and is compatible.) About 2.8 GB of downloads.
    log "dgl: installing torch==$DGL_TORCH_VERSION dgl==$DGL_VERSION (about 2.8 GB to download;" \
        "log: $LOGS/dgl.log)"
    run_logged "$LOGS/dgl.log" "$ROOT/dgl/bin/python" -m pip install "torch==$DGL_TORCH_VERSION" \
        "dgl==$DGL_VERSION" 'numpy<2' 'setuptools<70' pandas pyyaml pydantic
    # torchdata 0.7.1 (the release DGL 2.1's GraphBolt imports) pins torch 2.1.x in its metadata,
    # although it works with 2.2: installed without its dependencies so torch stays 2.2.1.
    run_logged "$LOGS/dgl.log" "$ROOT/dgl/bin/python" -m pip install --no-deps \
        "torchdata==$TORCHDATA_VERSION"
    resolved=$("$ROOT/dgl/bin/python" -c 'import torch; print(torch.__version__)')
    if [[ ${resolved%%+*} != "$DGL_TORCH_VERSION" ]]; then
        log "dgl: pip resolved torch $resolved, expected $DGL_TORCH_VERSION"
        exit 1
    fi

    log "dgl: verifying dgl.dataloading.NeighborSampler"
    "$ROOT/dgl/bin/python" "$HERE/verify_dgl.py"
    echo "$fp" >"$ROOT/dgl/.ready"
    log "dgl: ready in $(($(date +%s) - start)) s"
}

target=${1:-all}
mkdir -p "$LOGS"
case $target in
    pyg) build_pyg ;;
    dgl) build_dgl ;;
    # Not `build_pyg && build_dgl`: bash ignores `set -e` inside functions called from `&&`.
    all)
        build_pyg
        build_dgl
        ;;
    *) echo "usage: $0 [pyg|dgl|all]" >&2; exit 2 ;;
esac
