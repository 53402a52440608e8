python3 benchmarks/kernels/bench_paged_attention.py --mosaic-decode --decode-variants mosaic-only --only decode --skip-sweep --budget-s 500 --decode-filter 1x512,1x1024,1x2048,1x4096,1x8192,8x512,8x1024,8x2048,8x4096,8x8192,32x512,32x1024,32x2048,32x4096,32x8192 --out $OUT/g1 > $OUT/g1.log 2>&1
tail -25 $OUT/g1/kernels_table.txt 2>/dev/null || tail -20 $OUT/g1.log
