#!/usr/bin/env bash
# What issue 10 item 5 still lacks after the first GPU session (benchmarks/results/cuda.md, "Not measured"), in one
# call of at most about 8.5 minutes (the phases' time limits add up to 530 s), most useful first; each phase appends
# what it finished:
# LOCOST at 1,000,000 tokens, profiles of a training step (LOCOST and LongT5-local, bfloat16, 16K), Dodo's prefill
# and compression timed with the synchronised script, transformers' T5 generate(), generate() in float32, LED's
# checkpointed step at 64K, the suite's encode cells with the accelerator pieces of 32,768, and last the CUDA tests
# (tests/test_cuda.py) on the code as it is now. Without a CUDA device it stops after printing the environment.
#
#   benchmarks/run_cuda_gaps.sh [OUT]          # default benchmarks/results/cuda-gaps
#   SMOKE=1 benchmarks/run_cuda_gaps.sh OUT    # every phase on the CPU with tiny sizes: checks the commands only
#
# On a lent GPU, from the repository root, with .whl carried (the device image's transformers and peft differ from the
# versions the CPU suite uses):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD benchmarks/run_cuda_gaps.sh "$OUT"
#
# OUT gets log.txt (everything printed, with each phase's start time), bf16/cells.jsonl, fp32/cells.jsonl,
# profiles.md and dodo.json. Reports: python benchmarks/run_all.py --report_only --suites locost --device cuda
# --dtype bfloat16 --out OUT/bf16 (and the same for fp32).
set -u
out=${1:-benchmarks/results/cuda-gaps}
. "$(dirname "$0")/gpu_phases.sh"  # $log, $start; phase, environment_or_stop
mkdir -p "$out/bf16" "$out/fp32"

if [ "${SMOKE:-0}" = 1 ]; then  # float32 for bfloat16 too: a CPU without bfloat16 units takes minutes per roofline
  device=cpu; quick=--quick; bf16=float32; scale=256; long=128; mid=64; short=32
  dodo="--lengths 256 --steps 2 --rounds 2 --warmup 1"
else
  device=cuda; quick=; bf16=bfloat16; scale=1000000; long=65536; mid=16384; short=4096; dodo=
fi
suite="python3 benchmarks/run_all.py --suites locost --device $device --in_process --cells_only $quick"
profile="python3 benchmarks/profile_step.py --device $device --dtype $bf16 --task train --length $mid $quick"

environment_or_stop

phase "LOCOST at $scale tokens, bfloat16 (the accelerator pieces of 32,768)"
timeout 90 $suite --dtype $bf16 --out "$out/bf16" --models locost --tasks scale --scale_lengths $scale \
  --skip_flops >> "$log" 2>&1
phase "profiles of a training step at $mid tokens, bfloat16: LOCOST, then LongT5-local"
timeout 60 $profile --model locost --out "$out/profiles.md" >> "$log" 2>&1
timeout 45 $profile --model longt5-local --out "$out/profiles.md" >> "$log" 2>&1
phase "Dodo vs Llama, float32: prefill and compression synchronised"
timeout 60 python3 benchmarks/benchmark_dodo.py --device $device $dodo --json "$out/dodo.json" >> "$log" 2>&1
phase "T5 generate at $short and $mid tokens, bfloat16"
timeout 75 $suite --dtype $bf16 --out "$out/bf16" --models t5 --tasks generate --lengths $short $mid \
  --skip_flops >> "$log" 2>&1
phase "generate at $mid tokens, float32: LOCOST and LongT5-local (each cell about 20 s: 3 runs of 256 steps)"
timeout 75 $suite --dtype float32 --out "$out/fp32" --models locost longt5-local --tasks generate \
  --lengths $mid --skip_flops >> "$log" 2>&1
phase "LED's checkpointed training step at $long tokens, bfloat16"
timeout 45 $suite --dtype $bf16 --out "$out/bf16" --models led --tasks train_ckpt --lengths $long \
  --skip_flops >> "$log" 2>&1
phase "LOCOST and LongT5-local encode cells, bfloat16"
timeout 45 $suite --dtype $bf16 --out "$out/bf16" --models locost longt5-local --tasks encode \
  --lengths $short $mid $long --skip_flops >> "$log" 2>&1
phase "the CUDA tests (tests/test_cuda.py), against the code as it is now"
[ "$device" = cuda ] && timeout 35 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >> "$log" 2>&1
phase done
