python3 benchmarks/kernels/bench_paged_attention.py --mosaic --prefill-only --only prefill --skip-sweep --budget-s 520 --out $OUT/p > $OUT/p.log 2>&1
grep -A40 "^prefill/mixed" $OUT/p/kernels_table.txt 2>/dev/null | head -60 || tail -20 $OUT/p.log
