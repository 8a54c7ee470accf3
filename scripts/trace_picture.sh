#!/usr/bin/env bash
# Regenerate docs/layerwise-timeline.png (shown in docs/simulator.md): the layer-wise prefetch example
# (docs/examples/layerwise_prefetch.py) on the simulated device with the "h200" cost profile, its timeline
# written as Chrome trace-event JSON, then drawn by `kvoffload-ref trace-plot` (needs matplotlib:
# pip install "kvoffload_ref[plot]"). Deterministic: the sim's virtual clock.
#
#   bash scripts/trace_picture.sh [OUT.png]
#   bash scripts/trace_picture.sh --demo [OUT.png]   # docs/demo-trace.png: the demo's five acts, one panel each
set -euo pipefail
demo=0
if [ "${1:-}" = --demo ]; then demo=1; shift; fi
default=docs/layerwise-timeline.png
[ "$demo" = 1 ] && default=docs/demo-trace.png
out="${1:-$default}"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
trace="$(mktemp --suffix=.json)"
trap 'rm -f "$trace"' EXIT
if [ "$demo" = 1 ]; then
    "$PY" -m kvoffload_ref demo --trace "$trace" > /dev/null
    "$PY" -m kvoffload_ref trace-plot "$trace" "$out" \
        --title "kvoffload-ref demo --trace: the five acts on the simulated device, one panel (and time axis) each"
    exit 0
fi
"$PY" docs/examples/layerwise_prefetch.py --profile h200 --trace "$trace"
"$PY" -m kvoffload_ref trace-plot "$trace" "$out" \
    --title 'layer-wise prefetch, sim profile "h200": offload, then loads under compute, stores behind it'
