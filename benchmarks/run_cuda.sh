#!/usr/bin/env bash
# Issue 10 item 5 on one GPU, in one go (about 10 minutes on an H200): the CUDA tests, then the LOCOST suite in
# bfloat16 and float32 (cells run in this process: --in_process), VCC-T5 and Dodo. Ordered so that a run cut short
# keeps the most useful results; each phase has its own time limit and appends what it finished.
#
#   benchmarks/run_cuda.sh [OUT]            # default benchmarks/results/cuda
#   python benchmarks/run_all.py --report_only --suites locost --device cuda --dtype bfloat16 --out OUT/bf16
#   python benchmarks/run_all.py --report_only --suites locost --device cuda --dtype float32 --out OUT/fp32
#
# OUT gets log.txt (everything printed, with the phases' start times), bf16/cells.jsonl, fp32/cells.jsonl,
# vcc.json, dodo.json and dodo_training.json.
set -u
out=${1:-benchmarks/results/cuda}
mkdir -p "$out/bf16" "$out/fp32"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
start=$(date +%s)
phase() { echo "=== $(( $(date +%s) - start )) s: $*" >> "$log"; }

phase environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| peft', peft.__version__, '|', torch.cuda.get_device_name())"; } >> "$log" 2>&1

phase "CUDA tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -s tests/test_cuda.py >> "$log" 2>&1

locost="python3 benchmarks/run_all.py --suites locost --device cuda --in_process --cells_only"
phase "LOCOST suite, bfloat16, 1K-16K"
timeout 200 $locost --dtype bfloat16 --out "$out/bf16" --tasks encode train train_ckpt \
  --lengths 1024 4096 16384 >> "$log" 2>&1
phase "LOCOST suite, bfloat16, generate"
timeout 60 $locost --dtype bfloat16 --out "$out/bf16" --tasks generate --lengths 4096 16384 --skip_flops >> "$log" 2>&1
phase "LOCOST suite, bfloat16, 64K (not T5: its [12, 64K, 64K] position bias alone is 96 GiB) and 1M tokens"
timeout 70 $locost --dtype bfloat16 --out "$out/bf16" --tasks encode train train_ckpt scale --lengths 65536 \
  --scale_lengths 1000000 --models locost longt5-local longt5-tglobal led >> "$log" 2>&1
phase "LOCOST suite, float32"
timeout 80 $locost --dtype float32 --out "$out/fp32" --tasks encode train --lengths 4096 16384 >> "$log" 2>&1
timeout 30 $locost --dtype float32 --out "$out/fp32" --tasks generate --lengths 16384 --skip_flops >> "$log" 2>&1

phase "VCC-T5 vs T5, bfloat16"
timeout 60 python3 benchmarks/benchmark_vcc_t5.py --device cuda --dtype bfloat16 --vcc_lengths 16384 65536 131072 \
  --t5_lengths 16384 65536 --repeats 3 --json "$out/vcc.json" >> "$log" 2>&1
phase "Dodo vs Llama, float32"
timeout 40 python3 benchmarks/benchmark_dodo.py --device cuda --json "$out/dodo.json" >> "$log" 2>&1
timeout 40 python3 benchmarks/benchmark_dodo.py --device cuda --training_memory --json "$out/dodo_training.json" \
  >> "$log" 2>&1
phase done
