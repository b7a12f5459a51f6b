#!/usr/bin/env bash
# What the third GPU session left (benchmarks/results/cuda.md, "Not measured"): LOCOST's training step compiled, which
# failed under the GPU image's torch 2.11 (a dynamo assertion on the fused feed-forward function once sizes were
# symbolic; under torch.compile that sublayer now runs through its modules, checked on CPU with torch 2.11). Surest
# first; each phase appends what it finished; the phases' time limits add up to 540 s:
#   1. the CUDA tests (tests/test_cuda.py) against the code as it is now;
#   2. LOCOST's training step at 16K tokens, bfloat16, compiled block by block (transformers' regional compilation)
#      with CUDA graphs (mode reduce-overhead), then without (mode default);
#   3. the eager steps of LOCOST and LongT5-local, and LongT5-local's compiled with CUDA graphs, on the same machine
#      (the third session's: 0.151 s eager and 0.06-0.07 s with CUDA graphs on an H100);
#   4. LOCOST's decoding steps at 4K tokens, bfloat16: dynamic cache, static cache, static cache with the step compiled
#      (CUDA graphs), which generate() does by itself with cache_implementation="static".
# The fourth session ran it on an H100 (benchmarks/results/cuda.md, "Fourth session"; files in cuda-session4/).
# Without a CUDA device it stops after printing the environment.
#
#   benchmarks/run_cuda_next.sh [OUT]          # default benchmarks/results/cuda-next
#   SMOKE=1 benchmarks/run_cuda_next.sh OUT    # on the CPU with tiny sizes and the aot_eager backend: the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses). Install the wheels into their own folder: in the fourth session a plain `pip install`
# left the image's transformers 5.17.0 and peft 0.21.0 in front of them. OUT holds 7 files, within the 8 the device
# tool returns:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD benchmarks/run_cuda_next.sh "$OUT/next"
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
  device=cpu; dtype=float32; length=32; decode_length=32; size=--quick; backend="--backend aot_eager"; fast=default
  slow=default
else
  device=cuda; dtype=bfloat16; length=16384; decode_length=4096; size=; backend=; fast=reduce-overhead; slow=default
fi
step="python3 benchmarks/benchmark_compiled_step.py --device $device --dtype $dtype --lengths $length $size"

environment_or_stop

phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1

phase "LOCOST's training step at $length tokens, $dtype, compiled block by block ($fast, then $slow)"
timeout 150 $step $backend --models locost --modes $fast --scope blocks --repeats 5 \
  --json "$out/compiled-blocks-locost-$fast.json" >> "$log" 2>&1
timeout 75 $step $backend --models locost --modes $slow --scope blocks --repeats 5 \
  --json "$out/compiled-blocks-locost-$slow.json" >> "$log" 2>&1

phase "eager steps of LOCOST and LongT5-local, then LongT5-local compiled block by block ($fast)"
for model in locost longt5-local; do
  timeout 40 $step --models $model --modes eager --repeats 8 --json "$out/eager-$model.json" >> "$log" 2>&1
done
timeout 90 $step $backend --models longt5-local --modes $fast --scope blocks --repeats 5 \
  --json "$out/compiled-blocks-longt5-local-$fast.json" >> "$log" 2>&1

phase "LOCOST's decoding steps at $decode_length tokens, $dtype: dynamic, static, static compiled ($fast)"
timeout 85 python3 benchmarks/benchmark_static_decode.py --device $device --dtype $dtype --lengths $decode_length \
  $size $backend --mode $fast --models locost --new_tokens 32 --repeats 2 --json "$out/static-decode-locost.json" \
  >> "$log" 2>&1
phase done
