# Sourced by the GPU scripts (run_cuda_gaps.sh, run_cuda_next.sh, run_cuda_compiled_profile.sh) once they have set
# $out, their output folder: creates it, sets $log ($out/log.txt) and $start, and unbuffers Python's output. Then
# `phase TEXT` appends "=== SECONDS s: TEXT" to $log; `environment_or_stop` (once $device is set) appends the GPU, torch,
# transformers and peft versions, and ends the script (exit 3, printing the log) when $device is cuda and torch sees
# no CUDA device.
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
start=$(date +%s)

phase() { echo "=== $(( $(date +%s) - start )) s: $*" >> "$log"; }

environment_or_stop() {
  phase environment
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| peft', peft.__version__, '| cuda', torch.cuda.is_available())"; } >> "$log" 2>&1
  if [ "$device" = cuda ] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    phase "no CUDA device: stopping before the phases"; cat "$log"; exit 3
  fi
}
