#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has torch, triton, transformers; not pydantic), into .whl/ for the device
# call's carry: pydantic and the packages it imports, at the versions installed in .venv, for the machine's CPython
# 3.12 on manylinux x86-64 (typing-extensions too: pydantic asks for a newer one than the machine may have). The device call then starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# (benchmarks/inductor_gpu_checks.py's docstring has the whole command).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
rm -rf .whl && mkdir -p .whl  # one version of each: two stop the install there
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  version=$(.venv/bin/python -m pip show "$name" | sed -n 's/^Version: //p')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$version"
done
ls -l .whl
