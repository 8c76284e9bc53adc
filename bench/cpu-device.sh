#!/usr/bin/env bash
# One H200 call for kernels/cpu (issue 22) on the device's host CPU (Emerald Rapids: AMX-BF16/INT8, AVX512-FP16, the
# tiers this project's Zen 4 VM cannot run). No vLLM there. Carry: .whl (bench/device-setup.sh installs it; our CPU
# code needs only platformdirs). Builds every tier, runs the CPU op's tests (AMX, AVX512-FP16 and int8 included),
# then bench/cpu_rows.py (ROWS_SECONDS > 0: the GEMV against the GEMM path at ROWS rows on ROWS_TIERS, ROWS_THREADS,
# ROWS_ARGS), bench/cpu_gemm.py (GEMM_SECONDS > 0: the library's fp32 GEMM against BLAS, fp32 rows: GEMM_ROWS, GEMM_THREADS)
# and bench/cpu_host.py (BENCH_SECONDS > 0: one row at THREADS, the T0-prefetch library beside the shipped one,
# prefill-512 per linear). Logs and JSON go to $OUT.
set -u
source bench/device-setup.sh
grep -m1 "model name" /proc/cpuinfo; nproc; g++ --version | head -1
grep -o -w -E "amx_bf16|amx_int8|amx_tile|avx512_fp16|avx512_bf16|avx512_vnni|avx512vbmi|avx_vnni" /proc/cpuinfo | sort | uniq -c
lscpu | grep -E "L2|L3|NUMA node0"
cd /tmp || exit 1
for tier in avx512 avx2vnni avx2 portable; do python3 -P -m exl3local.kernels.cpu.build $tier & done; wait
echo "built at +$(( $(date +%s) - start )) s"
timeout ${TEST_SECONDS:-150} python3 -P -m pytest -q -rs -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  "$REPO"/tests/kernels/test_cpu.py "$REPO"/tests/kernels/test_cpu_amx.py "$REPO"/tests/kernels/test_cpu_int8.py "$REPO"/tests/kernels/test_cpu_heap.py \
  "$REPO/tests/kernels/test_dispatch.py::test_cpu_chooses_the_cpu_kernel_then_the_reference" \
  "$REPO/tests/kernels/test_selftest.py::test_the_cpu_librarys_checks_are_named_for_the_path_that_serves_their_activations" \
  "$REPO/tests/kernels/test_selftest.py::test_the_cpu_gemm_check_refuses_either_amx_form_that_is_wrong" \
  2>&1 | tail -40 | tee "$OUT/tests.log"
echo "tests done at +$(( $(date +%s) - start )) s"
[ "${ROWS_SECONDS:-0}" -gt 0 ] && timeout "$ROWS_SECONDS" python3 -P "$REPO/bench/cpu_rows.py" --tiers "${ROWS_TIERS:-avx512,avx2vnni}" \
  --rows "${ROWS:-2,4,8,12,16,20,24,32,40}" --threads "${ROWS_THREADS:-1,4,16}" --reps "${ROWS_REPS:-5}" --int8 ${ROWS_ARGS:-} \
  --out "$OUT/cpu_rows.json" 2>&1 | tee "$OUT/cpu_rows.log"
echo "rows done at +$(( $(date +%s) - start )) s"
[ "${GEMM_SECONDS:-0}" -gt 0 ] && timeout "$GEMM_SECONDS" python3 -P "$REPO/bench/cpu_gemm.py" --dtype fp32 \
  --rows "${GEMM_ROWS:-64,128,512}" --threads "${GEMM_THREADS:-1,16}" --out "$OUT/cpu_gemm.json" 2>&1 | tee "$OUT/cpu_gemm.log"
echo "gemm done at +$(( $(date +%s) - start )) s"
[ "${BENCH_SECONDS:-150}" -gt 0 ] && timeout ${BENCH_SECONDS:-150} python3 -P "$REPO/bench/cpu_host.py" --threads ${THREADS:-1,2,4,8,16} --prefill 512 \
  --prefill-threads ${PREFILL_THREADS:-1,4,16} --hint-before T0 ${BENCH_ARGS:-} --out "$OUT/cpu_host.json" 2>&1 | tee "$OUT/cpu_host.log"
echo "bench done at +$(( $(date +%s) - start )) s"
