#!/usr/bin/env bash
# The second GPU call of issue 10 item 5 (after run_cuda.sh): the CUDA tests after their fixes, LOCOST's long-input
# path by piece length (benchmark_locost_chunking.py, with a profile at 16K), the bfloat16 generate cells at 16K and
# T5 at 64K beside VCC-T5. Usage: benchmarks/run_cuda_followup.sh [OUT]
set -u
out=${1:-benchmarks/results/cuda}
mkdir -p "$out/bf16"
export PYTHONUNBUFFERED=1
log="$out/log2.txt"
start=$(date +%s)
phase() { echo "=== $(( $(date +%s) - start )) s: $*" >> "$log"; }
phase "CUDA tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider -s tests/test_cuda.py >> "$log" 2>&1
phase "LOCOST long-input path by piece length, bfloat16"
timeout 70 python3 benchmarks/benchmark_locost_chunking.py --device cuda --dtype bfloat16 --lengths 16384 65536 \
  --chunks 2048 8192 32768 0 --repeats 2 --profile 16384 >> "$log" 2>&1
phase "LOCOST suite, bfloat16, generate at 16K"
timeout 70 python3 benchmarks/run_all.py --suites locost --device cuda --in_process --cells_only --dtype bfloat16 \
  --out "$out/bf16" --tasks generate --lengths 16384 --skip_flops >> "$log" 2>&1
phase "T5 at 64K (VCC-T5 benchmark dims)"
timeout 30 python3 benchmarks/benchmark_vcc_t5.py --device cuda --dtype bfloat16 --vcc_lengths --t5_lengths 65536 \
  --repeats 3 >> "$log" 2>&1
phase done
