#!/usr/bin/env bash
# What the second GPU session left (benchmarks/results/cuda.md, "Not measured"), in one call of at most about 6 minutes
# (the phases' time limits add up to 345 s), most useful first; each phase appends what it finished:
# LOCOST's and LongT5-local's training step compiled (torch.compile, then with CUDA graphs) against eager, bfloat16,
# 16K tokens (LOCOST's step launches twice LongT5-local's operators and the GPU waits for the host; its training forward
# now compiles as one graph); then the CUDA tests on the code as it is now. Without a CUDA device it stops after
# printing the environment.
#
#   benchmarks/run_cuda_next.sh [OUT]          # default benchmarks/results/cuda-next
#   SMOKE=1 benchmarks/run_cuda_next.sh OUT    # on the CPU with tiny sizes and the aot_eager backend: the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses):
#   pip install -q --no-deps .whl/*.whl && PYTHONPATH=$PWD benchmarks/run_cuda_next.sh "$OUT"
#
# OUT gets log.txt (everything printed, with each phase's start time) and compiled-MODEL.json per model.
set -u
out=${1:-benchmarks/results/cuda-next}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
start=$(date +%s)
. "$(dirname "$0")/gpu_phases.sh"  # phase, environment_or_stop

if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu; dtype=float32; length=32; size=--quick; backend="--backend aot_eager"; modes="eager default"
else
  device=cuda; dtype=bfloat16; length=16384; size=; backend=; modes="eager default reduce-overhead"
fi

environment_or_stop

phase "training step at $length tokens, $dtype: eager against torch.compile ($modes), LOCOST then LongT5-local"
for model in locost longt5-local; do
  timeout 150 python3 benchmarks/benchmark_compiled_step.py --device $device --dtype $dtype --lengths $length $size \
    $backend --models $model --modes $modes --json "$out/compiled-$model.json" >> "$log" 2>&1
done
phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1
phase done
