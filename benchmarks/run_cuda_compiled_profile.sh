#!/usr/bin/env bash
# Why LOCOST's compiled training step was slower than its eager one on the fourth GPU session's H100 (16K tokens,
# bfloat16: eager 0.236 s, compiled block by block 0.331 s, with CUDA graphs 0.288 s; LongT5-local 0.171 s eager and
# 0.062 s with CUDA graphs). Each cell times its steps, then profiles one more step (`--profile`: the operators with
# the most device time, the step's device time and its kernel launches). The phases' time limits add up to 390 s:
#   1. LOCOST eager, then compiled block by block (mode default);
#   2. LOCOST with its whole forward compiled (one graph: `--scope model`, mode default);
#   3. LongT5-local eager, then compiled block by block (mode default), the same profile for comparison.
#
#   benchmarks/run_cuda_compiled_profile.sh [OUT]     # default benchmarks/results/cuda-compiled-profile
#   SMOKE=1 benchmarks/run_cuda_compiled_profile.sh OUT   # on the CPU, tiny sizes, the aot_eager backend
#
# On a lent GPU, from the repository root, with .whl carried. Install the wheels into their own folder first
# (`pip install` into the image's site-packages left the image's transformers 5.17.0 in place in the fourth session):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD benchmarks/run_cuda_compiled_profile.sh "$OUT/profile"
set -u
out=${1:-benchmarks/results/cuda-compiled-profile}
. "$(dirname "$0")/gpu_phases.sh"  # $log, $start; phase, environment_or_stop

if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu; dtype=float32; length=32; size=--quick; backend="--backend aot_eager"
else
  device=cuda; dtype=bfloat16; length=16384; size=; backend=
fi
step="python3 benchmarks/benchmark_compiled_step.py --device $device --dtype $dtype --lengths $length $size --profile 30"

environment_or_stop

phase "LOCOST at $length tokens, $dtype: eager, then compiled block by block (default), each profiled"
timeout 120 $step $backend --models locost --modes eager default --scope blocks --repeats 3 \
  --json "$out/locost-blocks.json" >> "$log" 2>&1

phase "LOCOST, the whole forward compiled (default), profiled"
timeout 180 $step $backend --models locost --modes default --scope model --repeats 3 \
  --json "$out/locost-model.json" >> "$log" 2>&1

phase "LongT5-local: eager, then compiled block by block (default), each profiled"
timeout 90 $step $backend --models longt5-local --modes eager default --scope blocks --repeats 3 \
  --json "$out/longt5-local-blocks.json" >> "$log" 2>&1
phase done
