source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/log.txt
for f in test_forms test_zoo test_robustness test_written_scan test_split_states; do
  ( timeout 230 python -m pytest -m gpu -q -p no:cacheprovider -rf tests/$f.py > /tmp/t_$f.txt 2>&1; echo "rc=$?" >> /tmp/t_$f.txt ) &
done
wait
for f in /tmp/t_*.txt; do echo "== $f" >> $OUT/log.txt; tail -25 $f >> $OUT/log.txt; done
echo "== demo" >> $OUT/log.txt
timeout 110 python examples/naive_mamba.py >> $OUT/log.txt 2>&1; echo "rc=$?" >> $OUT/log.txt
timeout 200 python -m benchmarks.bench_block_sparse --out $OUT/bsp_b32.json --targets cuda >> $OUT/log.txt 2>&1; echo "bsp rc=$?" >> $OUT/log.txt
