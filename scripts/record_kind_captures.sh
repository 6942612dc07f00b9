#!/usr/bin/env bash
# Record the engine capture of the bundled 2-layer tiny Qwen3 (one prefill of 16 tokens: capture.json and the
# kernel buffers) as this CPU's own kind and as every kind it can pose as, into fixtures/captures/tiny-qwen3-KIND.
# tests/test_kind_captures.py analyses them without the engine, so every machine checks every recorded kind.
# Run on a CPU with AMX tiles to record all four kinds: `bash scripts/record_kind_captures.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
kinds=$(.venv/bin/python -c "from graphdiff.capture.cpu_kind import native_kind, posable_kinds; \
print(native_kind(), *posable_kinds())")
for kind in $kinds; do
  tmp=$(mktemp -d)
  echo "[record] tiny:qwen3 as '$kind'"
  GRAPHDIFF_CPU_KIND="$kind" .venv/bin/graphdiff capture tiny:qwen3 --engine vllm --out "$tmp/capture"
  out=fixtures/captures/tiny-qwen3-$kind
  mkdir -p "$out"
  cp "$tmp/capture/capture.json" "$tmp/capture/buffers.pt" "$out/"
  rm -rf "$tmp"
done
