python3 benchmarks/kernels/bench_paged_attention.py --mosaic-decode --decode-variants mosaic-only --only decode --skip-sweep --budget-s 500 --decode-filter 64x512,64x1024,64x2048,64x4096,64x8192,128x512,128x1024,128x2048,128x4096,128x8192,256x512,256x1024,256x2048,256x4096,256x8192 --out $OUT/g2 > $OUT/g2.log 2>&1
tail -25 $OUT/g2/kernels_table.txt 2>/dev/null || tail -20 $OUT/g2.log
