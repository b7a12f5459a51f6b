#!/usr/bin/env bash
# What the fourth GPU session left (benchmarks/results/cuda.md, "Not measured"); that session ran this script as it was
# at 57c45ee (git show 57c45ee:benchmarks/run_cuda_next.sh), and the fifth as it is now (its results: cuda.md, "Fifth
# session"). Surest first; each phase appends what it finished; the phases' time limits add up to 560 s:
#   1. the CUDA tests (tests/test_cuda.py) against the code as it is now;
#   2. LOCOST's and LongT5-local's training steps at 16K tokens, bfloat16, eager and compiled block by block with CUDA
#      graphs (mode reduce-overhead), on one machine: the fourth session timed LOCOST's after its fix (0.124 s against
#      0.231 s eager) on another machine than LongT5-local's (0.062 s);
#   2b. LOCOST's eager step at 16K with the FFT convolution over all channels at once (--fft_block_elements 2**40)
#      against the library's blocks of about 2^22 FFT elements: 1,080 fewer operators (benchmarks/results/ops_16k.md),
#      about 100 MB more per complex temporary; time and peak memory;
#   3. decoding steps at 4K tokens, bfloat16, LOCOST, VCC-T5 and transformers' T5: dynamic cache, static cache, static
#      cache compiled (CUDA graphs), as generate() does with cache_implementation="static";
#   4. the corpus command (benchmark_corpus.py: a small random LOCOST, 64 documents of 64 to 4,096 tokens) with length
#      buckets, dynamic against static cache (`longreach summarize --cache_implementation static`), the compiles in it.
# Without a CUDA device it stops after printing the environment.
#
#   benchmarks/run_cuda_next.sh [OUT]          # default benchmarks/results/cuda-next
#   SMOKE=1 benchmarks/run_cuda_next.sh OUT    # on the CPU with tiny sizes and the aot_eager backend: the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses). Install the wheels into their own folder: in the fourth session a plain `pip install`
# left the image's transformers 5.17.0 and peft 0.21.0 in front of them. OUT holds 6 files, within the 8 the device
# tool returns:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD benchmarks/run_cuda_next.sh "$OUT/next"
#
# OUT gets log.txt (everything printed, with each phase's start time) and one JSON file per run.
set -u
out=${1:-benchmarks/results/cuda-next}
. "$(dirname "$0")/gpu_phases.sh"  # $log, $start; phase, environment_or_stop

if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu; dtype=float32; length=32; decode_length=32; size=--quick; backend="--backend aot_eager"; fast=default
  documents="--quick"
else
  device=cuda; dtype=bfloat16; length=16384; decode_length=4096; size=; backend=; fast=reduce-overhead
  documents="--documents 64"
fi
step="python3 benchmarks/benchmark_compiled_step.py --device $device --dtype $dtype --lengths $length $size"

environment_or_stop

phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1

phase "training steps at $length tokens, $dtype: LOCOST, then LongT5-local, eager and compiled block by block ($fast)"
for model in locost longt5-local; do
  timeout 100 $step $backend --models $model --modes eager $fast --scope blocks --repeats 5 \
    --json "$out/train-$model.json" >> "$log" 2>&1
done

phase "LOCOST's eager step at $length tokens: FFT convolution in blocks (the library's) against all channels at once"
timeout 40 $step --models locost --modes eager --repeats 5 --fft_block_elements $((2**40)) \
  --json "$out/train-locost-fft-one-block.json" >> "$log" 2>&1

phase "decoding steps at $decode_length tokens, $dtype, LOCOST, VCC-T5, T5: dynamic, static, static compiled ($fast)"
timeout 140 python3 benchmarks/benchmark_static_decode.py --device $device --dtype $dtype --lengths $decode_length \
  $size $backend --mode $fast --models locost vcc-t5 t5 --new_tokens 32 --repeats 2 \
  --json "$out/static-decode.json" >> "$log" 2>&1

phase "the corpus command, length buckets: dynamic against static cache"
timeout 120 python3 benchmarks/benchmark_corpus.py --device $device --dtype $dtype $documents \
  --runs bucketed bucketed_static --json "$out/corpus.json" >> "$log" 2>&1
phase done
