#!/usr/bin/env bash
# What the second GPU session left (benchmarks/results/cuda.md, "Not measured"), surest first; each phase appends
# what it finished. The phases' time limits add up to 800 s, more than a call: give the call the time there is and let
# its limit cut the last ones (typical times are well under the limits; compiling is the unknown).
#   1. the CUDA tests (tests/test_cuda.py) against the code as it is now;
#   2. the eager training step at 16K tokens, bfloat16: LOCOST with the feed-forward function's old steps (2**22
#      elements) and its accelerator default (2**24), and LongT5-local;
#   3. Dodo's decode step, prefill and compression in bfloat16 (1K, 4K, 16K);
#   4. VCC-T5's and T5's generate() of 64 tokens at 16K, float32, and their encoders again (T5's with a warm-up);
#   5. the training step compiled block by block: with CUDA graphs (mode reduce-overhead) for LOCOST then
#      LongT5-local, then without (mode default) (LOCOST's step launches more operators than LongT5-local's and the
#      GPU waits for the host).
# Without a CUDA device it stops after printing the environment.
#
#   benchmarks/run_cuda_next.sh [OUT]          # default benchmarks/results/cuda-next
#   SMOKE=1 benchmarks/run_cuda_next.sh OUT    # on the CPU with tiny sizes and the aot_eager backend: the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses):
#   pip install -q --no-deps .whl/*.whl && PYTHONPATH=$PWD benchmarks/run_cuda_next.sh "$OUT"
#
# OUT gets log.txt (everything printed, with each phase's start time) and one JSON file per run.
set -u
out=${1:-benchmarks/results/cuda-next}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
start=$(date +%s)
. "$(dirname "$0")/gpu_phases.sh"  # phase, environment_or_stop

if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu; dtype=float32; length=32; size=--quick; backend="--backend aot_eager"; modes="default"
  dodo="--lengths 64 --steps 2 --rounds 1 --warmup 1"; vcc="--vcc_lengths 2048 --t5_lengths 2048 --generate 2"
  old_steps=640
else
  device=cuda; dtype=bfloat16; length=16384; size=; backend=; modes="reduce-overhead default"
  dodo="--lengths 1024 4096 16384"; vcc="--vcc_lengths 16384 --t5_lengths 16384 --generate 64"
  old_steps=4194304
fi
step="python3 benchmarks/benchmark_compiled_step.py --device $device --dtype $dtype --lengths $length $size"

environment_or_stop

phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1

phase "eager training step at $length tokens, $dtype: LOCOST (feed-forward steps of $old_steps elements, then the default), LongT5-local"
timeout 40 $step --models locost --modes eager --feed_forward_step_elements $old_steps \
  --json "$out/eager-locost-old-steps.json" >> "$log" 2>&1
timeout 40 $step --models locost --modes eager --json "$out/eager-locost.json" >> "$log" 2>&1
timeout 40 $step --models longt5-local --modes eager --json "$out/eager-longt5-local.json" >> "$log" 2>&1

phase "Dodo in bfloat16"
timeout 45 python3 benchmarks/benchmark_dodo.py --device $device --dtype bfloat16 $dodo \
  --json "$out/dodo-bf16.json" >> "$log" 2>&1

phase "VCC-T5 and T5 generate(), float32; then their encoders again, with a warm-up run (none for T5 in session 2)"
timeout 60 python3 benchmarks/benchmark_vcc_t5.py --device $device $vcc --repeats 2 --timeout 50 \
  --json "$out/vcc-generate.json" >> "$log" 2>&1
timeout 40 python3 benchmarks/benchmark_vcc_t5.py --device $device ${vcc% --generate*} --repeats 3 --timeout 30 \
  --json "$out/vcc-encode.json" >> "$log" 2>&1

phase "training step compiled block by block ($modes), LOCOST then LongT5-local"
for mode in $modes; do
  for model in locost longt5-local; do
    timeout 120 $step $backend --models $model --modes $mode --scope blocks \
      --json "$out/compiled-blocks-$model-$mode.json" >> "$log" 2>&1
  done
done
phase done
