#!/bin/bash
# Device checks for issue 4 (one run): Triton on hardware, step time, Triton-backend dump.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 benchmarks/gpu_checks.py fixtures/scans/tiny-qwen3 .gpu/scans/tiny-qwen2 .gpu/scans/tiny-llama .gpu/scans/Qwen3-8B --json $OUT/gpu_checks.json > $OUT/gpu_checks.log 2>&1
echo "gpu_checks rc=$?"; grep -E '"(checks|triton_identical|triton_checks|torch_identical|max_ulp_triton|max_grad_rel_err|logits_identical_fraction|grads_finite|error)"' $OUT/gpu_checks.log
for spec in "Qwen3-1.7B 4" "Qwen3-8B 2"; do set -- $spec
  timeout 170 python3 benchmarks/patch_step_benchmark.py --scan .gpu/scans/$1 --config Qwen/$1 --device cuda --batch $2 --seq 4096 --steps 8 --variants unpatched,rope,all --allow-version-mismatch --json $OUT/step_$1.json > $OUT/step_$1.log 2>&1
  echo "step $1 rc=$?"; tail -c 1500 $OUT/step_$1.log
done
timeout 90 python3 benchmarks/record_triton_dump.py --out $OUT/dump > $OUT/dump.log 2>&1; echo "dump rc=$?"; tail -5 $OUT/dump.log
tar czf $OUT/triton-dump.tgz -C $OUT dump && rm -rf $OUT/dump
ls -la $OUT
