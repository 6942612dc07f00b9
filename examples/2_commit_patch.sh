#!/usr/bin/env bash
# Step 2: check the generated patch into the training repo as patches/graphdiff_patch.py + patches/manifest.json,
# in a commit of its own whose message says how to regenerate it. Nothing is committed when patches/ is unchanged.
#
#   examples/2_commit_patch.sh SCAN_DIR TRAIN_REPO
#
# SCAN_DIR: the scan directory of step 1 (its patch/ holds the generated files); TRAIN_REPO: a git work tree.
set -euo pipefail
scan=${1:?usage: $0 SCAN_DIR TRAIN_REPO}
repo=${2:?usage: $0 SCAN_DIR TRAIN_REPO}
patch="$scan/patch"
[ -f "$patch/manifest.json" ] || { echo "no $patch/manifest.json: run step 1 (graphdiff scan ... --patch)" >&2; exit 2; }

# manifest.json names the generated module (and holds its sha256: the runtime refuses an edited copy).
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$patch/manifest.json" "$1"; }
module=$(field module_file)
mkdir -p "$repo/patches"
cp "$patch/manifest.json" "$patch/$module" "$repo/patches/"

cd "$repo"
git add patches/manifest.json "patches/$module"
if git diff --cached --quiet -- patches; then
  echo "patches/ unchanged"
  exit 0
fi
git commit -q -m "graphdiff patch for $(field model)" -m "Regenerate: $(field scan_command)" -- patches
git log -1 --stat --format='committed %h: %s'
