#!/usr/bin/env bash
# Every GPU measurement of this project in one run on a CUDA machine (H100/H200), each step time-boxed so a
# slow one cannot starve the others; results go to OUT_DIR (default: ./gpu_out).
#   bash benchmarks/gpu_checks.sh [OUT_DIR] [SECONDS_FOR_SPEED]
# 1. the special function unit's exp2/log2 tables  (benchmarks/gpu_special_functions.py, ~30 s)
# 2. SDPA's kernels recorded on new launches        (benchmarks/gpu_record_kernels.py, ~1 min)
# 3. speed of the Triton kernels and the monitor    (benchmarks/gpu_speed.py, the rest)
set -u
out=${1:-gpu_out}
speed_s=${2:-300}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 benchmarks/gpu_special_functions.py "$out" || echo "special functions: exit $?"
timeout 240 python3 benchmarks/gpu_record_kernels.py "$out" --tar || echo "record kernels: exit $?"
timeout "$speed_s" python3 benchmarks/gpu_speed.py --json "$out/gpu_speed.json" || echo "gpu_speed: exit $?"
