#!/usr/bin/env bash
# What the fifth GPU session left (benchmarks/results/cuda.md, "Not measured"). The fourth and fifth sessions ran
# earlier versions of this script (git show 57c45ee:benchmarks/run_cuda_next.sh and 23739bd:benchmarks/run_cuda_next.sh;
# their results: cuda.md, "Fourth session" and "Fifth session"). Surest first; each phase appends what it finished; the
# phases' time limits add up to 500 s:
#   1. the CUDA tests (tests/test_cuda.py) against the code as it is now;
#   2. the corpus command's first pass (benchmark_corpus.py: a small random LOCOST, 256 documents of 64 to 4,096
#      tokens, length buckets, the dynamic cache), with and without each batch padded to a multiple of 512 tokens, each
#      run in a process of its own, in turn, twice each: the fifth session's first passes took 26 s, 12 s or 8.5 s
#      depending on what had run before them, and padding leaves 8 input lengths instead of 42;
#   3. LOCOST's and LongT5-local's bfloat16 generate() of 256 tokens at 16K (run_all.py's cells), not timed since
#      LOCOST's float32 change.
# Without a CUDA device it stops after printing the environment.
#
#   benchmarks/run_cuda_next.sh [OUT]          # default benchmarks/results/cuda-next
#   SMOKE=1 benchmarks/run_cuda_next.sh OUT    # on the CPU with tiny sizes: the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses). Install the wheels into their own folder: in the fourth session a plain `pip install`
# left the image's transformers 5.17.0 and peft 0.21.0 in front of them. OUT holds 6 files (log.txt, 4 corpus JSON
# files, gen/cells.jsonl), within the 8 the device tool returns:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD benchmarks/run_cuda_next.sh "$OUT/next"
set -u
out=${1:-benchmarks/results/cuda-next}
. "$(dirname "$0")/gpu_phases.sh"  # $log, $start; phase, environment_or_stop

if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu; dtype=float32; documents="--quick"; quick=--quick; length=64
else
  device=cuda; dtype=bfloat16; documents="--documents 256"; quick=; length=16384
fi

environment_or_stop

phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1

phase "the corpus command's first pass, dynamic cache: buckets as they are, and padded to multiples of 512 tokens"
for turn in 1 2; do
  for run in bucketed bucketed_padded; do
    timeout 55 python3 benchmarks/benchmark_corpus.py --device $device --dtype $dtype $documents --runs $run \
      --pad_to_multiple_of 512 --json "$out/corpus-$run-$turn.json" >> "$log" 2>&1
  done
done

phase "generate() of 256 tokens at $length tokens, $dtype: LOCOST and LongT5-local"
timeout 220 python3 benchmarks/run_all.py --suites locost --device $device --in_process --cells_only $quick \
  --dtype $dtype --out "$out/gen" --models locost longt5-local --tasks generate --lengths $length --skip_flops \
  >> "$log" 2>&1
phase done
