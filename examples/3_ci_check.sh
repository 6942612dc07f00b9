#!/usr/bin/env bash
# Step 3, the training repo's CI gate: re-scans the trainer with the checked-in patch applied against the engine as
# installed and configured now. Exit 0: the patch still holds; exit 1: it must be regenerated (the table says why:
# a version, the model config, the compile config, or a site it should align); exit 2: a usage error.
# Run it from the training repo's root, on a machine with the engine installed, in the training environment.
#
#   examples/3_ci_check.sh [MANIFEST] [graphdiff check options...]
#
# The report is markdown: printed to the log, and appended to $GITHUB_STEP_SUMMARY when set (GitHub Actions).
set -euo pipefail
manifest=${1:-patches/manifest.json}
shift $(($# < 1 ? $# : 1))

graphdiff check "$manifest" --format markdown "$@" | tee -a "${GITHUB_STEP_SUMMARY:-/dev/null}"
