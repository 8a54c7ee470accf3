#!/usr/bin/env bash
# Regenerate docs/layerwise-timeline.png (shown in docs/simulator.md): the layer-wise prefetch example
# (docs/examples/layerwise_prefetch.py) on the simulated device with the "h200" cost profile, its timeline
# written as Chrome trace-event JSON, then drawn by `kvoffload-ref trace-plot` (needs matplotlib:
# pip install "kvoffload_ref[plot]"). Deterministic: the sim's virtual clock.
#
#   bash scripts/trace_picture.sh [OUT.png]
set -euo pipefail
out="${1:-docs/layerwise-timeline.png}"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
trace="$(mktemp --suffix=.json)"
trap 'rm -f "$trace"' EXIT
"$PY" docs/examples/layerwise_prefetch.py --profile h200 --trace "$trace"
"$PY" -m kvoffload_ref trace-plot "$trace" "$out" \
    --title 'layer-wise prefetch, sim profile "h200": offload, then loads under compute, stores behind it'
