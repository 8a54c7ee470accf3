#!/usr/bin/env bash
# GPU check of the CuPy backend: the gpu-marked tests (CuPy arrays, a worker over a pinned allocation -- the route
# where host registration is refused -- included, then torch tensors and a torch stream when torch is installed,
# order_after included), the layer-wise prefetch example, then the benchmark, then the sim's "h200"
# cost profile against this GPU on three traced schedules (hard cap about 9.5 minutes in total: it fits one device
# call of at most 600 s).
#
#   bash scripts/gpu_check.sh [REPORT.md]
#
# Runs from the repository root whatever the current directory; needs no install (PYTHONPATH=.). The report goes
# to stdout and, if a path is given, to that file too; the benchmark's raw numbers go beside it as REPORT.json.
# Exit status: 0 if the CuPy backend's tests and the benchmark passed, 1 otherwise. Other modules' gpu-marked
# tests are run and reported, but do not change the exit status. PYTHON=... selects the interpreter.
set -u -o pipefail
report="${1:-}"
case "$report" in ""|/*) ;; *) report="$PWD/$report" ;; esac   # relative to the caller's directory
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

json_args=()
trace_args=()
if [ -n "$report" ]; then
    mkdir -p "$(dirname "$report")"
    json_args=(--json "${report%.*}.json")
    trace_args=(--out "${report%.*}-traces")   # each schedule's sim and GPU timelines, one file each (Perfetto)
fi
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

main() {
    local status=0
    # step LABEL SECONDS COUNTS(yes|no) COMMAND...
    step() {
        local label=$1 limit=$2 counts=$3 rc t0=$SECONDS
        shift 3
        printf '\n## %s\n\n```\n' "$label"
        timeout -k 10 "$limit" "$@"
        rc=$?
        printf '```\n(%s: exit %d after %d s%s)\n' "$label" "$rc" "$((SECONDS - t0))" \
            "$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo ", TIMED OUT at ${limit} s")"
        # pytest exit 5 = nothing collected (fine for the informational step)
        if [ "$counts" = yes ] && [ "$rc" -ne 0 ]; then status=1; fi
    }
    echo "# kvoffload_ref GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "python: $PY ($("$PY" --version 2>&1))"
    "$PY" -c 'import cupy, numpy, pytest; print("cupy", cupy.__version__, "| numpy", numpy.__version__, "| pytest", pytest.__version__)' 2>&1
    "$PY" -c 'import torch; print("torch", torch.__version__, "| CUDA", torch.version.cuda)' 2>&1 \
        || echo "torch: not installed (the torch tests are skipped)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 || true

    step "GPU usable" 60 yes "$PY" -c 'from kvoffload_ref.backends.cupy import gpu_usable
ok, why = gpu_usable(); print(ok, why); raise SystemExit(0 if ok else 1)'
    step "CuPy backend: gpu tests" 110 yes \
        "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs tests/test_backends_cupy.py
    step "CuPy backend with torch tensors and a torch compute stream: gpu tests" 90 yes \
        "$PY" -m pytest -p no:cacheprovider -m gpu -v -rs tests/test_backends_cupy_torch.py
    step "the layer-wise prefetch example on the GPU (order_after, R23)" 60 yes \
        "$PY" docs/examples/layerwise_prefetch.py --backend cupy
    step "CuPy backend: CPU tests with this CuPy (fake runtime, pure parsing, NVRTC compile)" 30 yes \
        "$PY" -m pytest -p no:cacheprovider -m "not gpu" -q -rs tests/test_backends_cupy.py \
        tests/test_backends_cupy_interop.py
    step "benchmark" 100 yes "$PY" scripts/gpu_bench.py ${json_args[@]+"${json_args[@]}"}
    # The sim's "h200" cost profile against this GPU: a scattered store, a concurrent store+load and the layer-wise
    # example, traced on both (CUDA events / virtual clock); totals and ratios (goal within +-15 %; a miss means the
    # profile in kvoffload_ref/backends/_simcost.py needs a refit to the benchmark above). Informational.
    step "sim profile h200 vs this GPU: trace totals of three schedules" 60 no \
        "$PY" scripts/sim_vs_gpu.py ${trace_args[@]+"${trace_args[@]}"}
    step "other modules' gpu tests (informational)" 50 no \
        "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs --continue-on-collection-errors tests/ \
        --ignore=tests/test_backends_cupy.py --ignore=tests/test_backends_cupy_torch.py \
        --ignore=tests/test_backends_cupy_interop.py

    echo
    if [ "$status" -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
    return "$status"
}

if [ -n "$report" ]; then
    main 2>&1 | tee "$report"
else
    main 2>&1
fi
