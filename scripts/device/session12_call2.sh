# Session 12, call 2: e2e with GPU clock/power samples (is the patched step's GEMM slowdown a
# clock effect?) and the steady-state phase profiles of both variants. Seven files come back.
set -u
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/smi_power.csv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 200 >> $OUT/smi_power.csv &
SMI=$!
python -u benchmarks/e2e_training.py --out $OUT --skip-max-seq 2>&1 | while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done > $OUT/e2e.log
python -u scripts/device/profile_e2e.py --out $OUT --steady 6 --variants hf,liger 2>&1 | while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done | tail -20
kill $SMI
python scripts/device/host_layers.py --out $OUT --variants hf,liger,liger-norecompute 2>&1 | tail -3
tail -4 $OUT/e2e.log; ls $OUT
