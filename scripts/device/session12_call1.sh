# Session 12, call 1 (see benchmarks/results/2026-12-05b_nvidia-h100/env.txt): attention layouts, e2e with GPU clock/power samples, host per layer.
# Kept as the record of what ran on commit 7a76565: its ab_e2e variant "ropecontig" and the RoPE flag it set were removed after this call.
set -u
export PYTHONPATH=$PWD/src
python scripts/device/sdpa_layout.py --out $OUT/sdpa_layout.csv 2>&1 | tail -12
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > $OUT/smi_power.csv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 250 >> $OUT/smi_power.csv &
SMI=$!
python -u benchmarks/e2e_training.py --out $OUT --skip-max-seq 2>&1 | while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done > $OUT/e2e.log
kill $SMI
python scripts/device/ab_e2e.py --variants base,ropecontig --rounds 2 --steps 10 --csv $OUT/ab_e2e_rope.csv 2>&1 | tail -5
for blas in default cublas cublaslt; do
  v=hf,liger; [ $blas = default ] && v=hf,liger,liger-norecompute
  python scripts/device/host_layers.py --out $OUT/$blas --blas $blas --variants $v 2>&1 | tail -3
  mv $OUT/$blas/host_layers*.txt $OUT/host_layers_$blas.txt; rm -rf $OUT/$blas
done
tail -6 $OUT/e2e.log; grep -h "per decoder layer" $OUT/host_layers_*.txt
