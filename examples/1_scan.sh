#!/usr/bin/env bash
# Step 1, on the engine's machine (vLLM installed, the engine as you serve it): scan the model against the engine
# and generate its patch into OUT/patch (graphdiff_patch.py + manifest.json).
#
#   examples/1_scan.sh MODEL [OUT] [graphdiff scan options...]
#
# MODEL: an HF id, a checkpoint directory or tiny:ARCH; OUT: the scan directory (default scans/<model name>).
# Options go to `graphdiff scan` as they are, e.g. -cc '{"mode": 3}' for the compilation config you serve with.
set -euo pipefail
model=${1:?usage: $0 MODEL [OUT] [graphdiff scan options...]}
name=$(basename "$model")
out=${2:-scans/${name#tiny:}}
shift $(($# < 2 ? $# : 2))

graphdiff scan "$model" --engine vllm --out "$out" --patch "$@"
echo "the patch to check in: $out/patch/ (graphdiff_patch.py, manifest.json)"
