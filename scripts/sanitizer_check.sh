#!/usr/bin/env bash
# Runs the reduced GPU workload under compute-sanitizer memcheck and racecheck.
# Usage: scripts/sanitizer_check.sh OUT_DIR   (on a CUDA machine)
# SANITIZER_TOOLS (default "memcheck racecheck") picks the tools. Each tool's full log is
# OUT_DIR/sanitizer_<tool>.log; sanitizer.txt gets the summaries and, for every reported
# hazard or error, its first lines (which kernel, which access), so it can be attributed.
set -u
out=${1:?usage: scripts/sanitizer_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=${PYTHONPATH:-}:src PYTORCH_NO_CUDA_MEMORY_CACHING=1
# PATH, the system CUDA toolkits, then CUDA pip wheels (nvidia-*/cuda-toolkit ship it under site-packages).
sanitizer=$(command -v compute-sanitizer || find /usr/local/cuda*/bin -name compute-sanitizer 2>/dev/null | head -1)
if [ -z "$sanitizer" ]; then
  sanitizer=$(find /usr /opt "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)" \
    -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -1)
fi
if [ -z "$sanitizer" ]; then echo "compute-sanitizer not found" | tee "$out/sanitizer.txt"; exit 1; fi
status=0
for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
  "$sanitizer" --tool "$tool" --error-exitcode 3 --print-limit 50 python3 scripts/sanitizer_workload.py \
    >"$out/sanitizer_$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer_$tool.log" | tail -1)
  echo "$tool: exit $rc; ${summary:-no summary line}" | tee -a "$out/sanitizer.txt"
  grep -E -A8 "^========= (Error|Invalid|Race reported|Warning)|hazard" "$out/sanitizer_$tool.log" | head -120 \
    >>"$out/sanitizer.txt"
  # Attribution: reports inside cuBLAS/cuDNN kernels (nvjet*, cutlass*, cudnn*, at::native) are
  # not this library's; the count that matters here is the one in liger's Triton kernels.
  ours=$(grep -E "^========= (Error|Invalid|.*Race reported)" -A1 "$out/sanitizer_$tool.log" \
    | grep -E "access at|at 0x|kernel" | grep -cvE "nvjet|cutlass|cudnn|cublas|at::native|void at_")
  echo "$tool: reports in other than cuBLAS/cuDNN/ATen kernels (liger's Triton kernels): $ours" | tee -a "$out/sanitizer.txt"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
