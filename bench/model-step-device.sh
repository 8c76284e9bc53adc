#!/usr/bin/env bash
# One H200 call (docs/PERF.md "Model step"). Carry: .whl (exllamav3 1.6.5 + deps) and .device-carry
# (ext/exllamav3_ext.so.part-*, the prebuilt extension of ../shared/device; shared/fixtures/exl3 for the tests).
# Logs and JSON go to $OUT.
#   PLAN=tiled (default): the GPU tests; flat vs shaped trellis-word loads per 27B linear group at M = 1, 16,
#     K4 and K3 (bench/layers.py flat); the tiled path (more than 16 rows) against the reconstruct path and
#     exllamav3 per linear group (bench/layers.py tiled: M = 32..256, split-K sweep at 64); whole steps of both
#     models at M = 64, 32, 128 with and without it (bench/model_step.py --tiled 128).
#   PLAN=step: every row count, ours + exllamav3's default, then exllamav3 with EXL3_INT8_GEMV=0 in a second
#     process (it reads the variable once per process).
#   PLAN=variants (session 13): the GPU tests (+ test_selftest, test_split_k); bench/one_launch.py --variants: whole
#     steps and per-group graph µs of both models at ROWS (default 4,1,16) with the split-K floor and the split loads
#     as served, as before (1:1) and in between (VARIANTS), and exllamav3 per group.
#   PLAN=prefill (session 14): the GPU tests of PLAN=variants (+ test_triton_linear's odd-rows test), then
#     bench/prefill_forms.py (27B parts at 4096/2048 rows: each reconstruct form, its pieces, exllamav3; whole 27B steps
#     at 4096/2048/512 with the form rule as served and as before), then bench/model_step.py at ROWS (64,512,4096).
#   PLAN=pieces (session 15): the GPU tests of the reconstruct path (TESTS), bench/prefill_pieces.py (the input
#     transform's row blocks, the W_r rebuild's variants and cuts, 27B steps at 4096/2048), then bench/model_step.py at
#     ROWS (1,4,16,64), every cell's eager timed first.
#   PLAN=frag (session 16): the fragment-order operand's tests (TESTS), then bench/one_launch.py --variants: whole steps
#     and per-group graph µs of both models at ROWS (default 1,4,16) with the weight operand in ring order and register
#     caps (VARIANTS) beside the served code, exllamav3 per group.
#   PLAN=final (session 16): bench/model_step.py at ROWS (default 1,4,16,64, every eager cell first), the served
#     code's A/B (bench/one_launch.py --variants VARIANTS at 27B M = 1, 4 and 35B-A3B M = 16), then the GPU test set
#     (test_set: four pytest processes since session 19) side by side until +TEST_END s (their logs tests_*.log) and, beside them, bench/prefill_forms.py's and
#     prefill_pieces.py's 27B steps at 512 rows (do they run: their times then mean nothing) and bench/sass_loop.py (the
#     decode loop as the device's Triton compiles it); EXTRAS=0 leaves those two out.
#   PLAN=kwidth (session 17): bench/sass_loop.py (the device's Triton), bench/one_launch.py --variants VARIANTS (default:
#     the fragment order for kWidth 2, and the served order with the words one K step ahead) at VROWS (1,4), then
#     bench/model_step.py at ROWS (1,4,16).
#   PLAN=parts (session 19): with ROWS set, bench/model_step.py --models 27b at ROWS first; bench/prefill_parts.py (27B
#     at 4096/512 rows: a fused layer's parts sharing one input transform vs each its own, exllamav3); with PROFILE=1,
#     bench/prefill_forms.py --profile at 4096 rows (one eager step of each side under torch's profiler); then the GPU
#     test set (test_set) as four pytest processes side by side until +TEST_END s; PARTS_ARGS: more prefill_parts.py
#     arguments.
#   PLAN=moe: the GPU tests; 35B steps with the MoE over expert-sorted tiles vs one unit per program (--units) vs
#     exllamav3 at ROWS (default 64,512,16,4096,4); then the 27B decode configs (bench/layers.py config, M = 1, 4).
set -u
source bench/device-setup.sh
[ -f /tmp/ext/exllamav3_ext.so ] || { echo "carry .device-carry/ext/exllamav3_ext.so.part-*"; exit 1; }
tests() {
  (cd /tmp && timeout ${TEST_SECONDS:-150} python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$REPO" \
    -c "$REPO/pyproject.toml" "$@" 2>&1 | tail -15 | tee "$OUT/tests.log")
  echo "tests done at +$(( $(date +%s) - start )) s"
}
run() { (cd /tmp && python3 -P "$REPO/bench/$1" --out "$OUT" "${@:2}"); }
part() { (cd /tmp && timeout $(( start + ${TEST_END:-560} - $(date +%s) )) python3 -P -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
  -c "$REPO/pyproject.toml" "${@:2}" > "$OUT/tests_$1.log" 2>&1; echo "rc $? at +$(( $(date +%s) - start )) s" >> "$OUT/tests_$1.log"); }
test_set() {  # the kernels' GPU tests, four processes side by side (session 19: test_selftest alone took ~300 s)
  part bound "$REPO"/tests/kernels/test_bound.py "$REPO"/tests/kernels/test_bound_group.py \
    "$REPO"/tests/kernels/test_split_k.py &
  part linear "$REPO"/tests/kernels/test_triton_linear.py "$REPO"/tests/kernels/test_triton_decode.py &
  part gpu_moe "$REPO"/tests/kernels/test_triton_gpu.py "$REPO"/tests/kernels/test_triton_moe.py &
  part selftest "$REPO"/tests/kernels/test_selftest.py -k "not cpu" &
}
if [ "${PLAN:-tiled}" = tiled ]; then
  tests "$REPO"/tests/kernels/test_bound.py "$REPO"/tests/kernels/test_triton_gpu.py \
    "$REPO"/tests/kernels/test_selftest.py::test_tiled_path_is_checked_only_where_it_is_on
  for bits in 4 3; do run layers.py flat --bits $bits 2>&1 | tee "$OUT/layers_flat_k$bits.log" | grep -v '^{'; done
  run layers.py tiled --deadline $(( start + ${LAYERS_SECONDS:-330} )) 2>&1 | tee "$OUT/layers_tiled.log" | grep -v '^{'
  echo "layers done at +$(( $(date +%s) - start )) s"
  run model_step.py --tiled 128 --tag model_step_tiled --rows ${ROWS:-64,32,128} --deadline $(( start + ${TOTAL_SECONDS:-540} )) 2>&1 \
    | tee "$OUT/model_step_tiled.log" | grep -v '^{'
elif [ "$PLAN" = variants ]; then
  TEST_SECONDS=${TEST_SECONDS:-330} tests ${TESTS:-"$REPO"/tests/kernels/test_triton_gpu.py \
    "$REPO"/tests/kernels/test_bound.py "$REPO"/tests/kernels/test_triton_moe.py "$REPO"/tests/kernels/test_selftest.py \
    "$REPO"/tests/kernels/test_split_k.py}
  run one_launch.py --variants ${VARIANTS:-1:1,1:4,8:1,4:4,16:4} --models 35b-a3b,27b --rows ${ROWS:-4,1,16} \
    --tag one_launch_variants --deadline $(( start + ${TOTAL_SECONDS:-570} )) 2>&1 \
    | tee "$OUT/one_launch_variants.log" | grep -v '^{'
elif [ "$PLAN" = prefill ]; then
  TEST_SECONDS=${TEST_SECONDS:-240} tests ${TESTS:-"$REPO"/tests/kernels/test_triton_gpu.py \
    "$REPO"/tests/kernels/test_bound.py "$REPO"/tests/kernels/test_triton_moe.py "$REPO"/tests/kernels/test_selftest.py \
    "$REPO"/tests/kernels/test_split_k.py \
    "$REPO/tests/kernels/test_triton_linear.py::test_every_path_with_bias_and_odd_rows"}
  run prefill_forms.py --deadline $(( start + ${FORMS_SECONDS:-400} )) 2>&1 | tee "$OUT/prefill_forms.log"
  echo "prefill forms done at +$(( $(date +%s) - start )) s"
  run model_step.py --rows ${ROWS:-64,512,4096} --tag model_step --deadline $(( start + ${TOTAL_SECONDS:-570} )) 2>&1 \
    | tee "$OUT/model_step.log" | grep -v '^{'
elif [ "$PLAN" = pieces ]; then
  TEST_SECONDS=${TEST_SECONDS:-150} tests ${TESTS:-"$REPO"/tests/kernels/test_bound.py \
    "$REPO"/tests/kernels/test_triton_linear.py "$REPO"/tests/kernels/test_triton_decode.py}
  run prefill_pieces.py --deadline $(( start + ${PIECES_SECONDS:-360} )) 2>&1 | tee "$OUT/prefill_pieces.log"
  echo "prefill pieces done at +$(( $(date +%s) - start )) s"
  run model_step.py --rows ${ROWS:-1,4,16,64} --tag model_step --deadline $(( start + ${TOTAL_SECONDS:-570} )) 2>&1 \
    | tee "$OUT/model_step.log" | grep -v '^{'
elif [ "$PLAN" = frag ]; then
  TEST_SECONDS=${TEST_SECONDS:-90} tests ${TESTS:-"$REPO"/tests/kernels/test_triton_decode.py}
  run one_launch.py --variants ${VARIANTS:-8:0:0:0:0,8:0:0:0:1:48,8:0:0:0:0:48,8:0:0:0:1:56} --models 27b,35b-a3b \
    --rows ${ROWS:-1,4,16} --tag one_launch_frag --deadline $(( start + ${TOTAL_SECONDS:-300} )) 2>&1 \
    | tee "$OUT/one_launch_frag.log" | grep -v '^{'
elif [ "$PLAN" = final ]; then
  run model_step.py --rows ${ROWS:-1,4,16,64} --tag model_step --deadline $(( start + ${STEP_SECONDS:-200} )) 2>&1 \
    | tee "$OUT/model_step.log" | grep -v '^{'
  echo "model steps done at +$(( $(date +%s) - start )) s"
  for cell in ${CELLS:-27b:1,4 35b-a3b:16}; do
    run one_launch.py --variants ${VARIANTS:-8:0:0:0:0,8:0:0:0:1:-1,8:0:0:0:0:-1} --models ${cell%%:*} \
      --rows ${cell#*:} --tag "one_launch_final_${cell%%:*}" --deadline $(( start + ${VARIANT_SECONDS:-300} )) 2>&1 \
      | grep -v '^{' >> "$OUT/one_launch_final.log"
  done
  echo "variants done at +$(( $(date +%s) - start )) s"
  test_set
  if [ "${EXTRAS:-1}" = 1 ]; then  # EXTRAS=0: the tests alone on the GPU (they finish sooner)
    (run prefill_forms.py --steps-only --step-rows 512; run prefill_pieces.py --rows 1024 --step-rows 512) \
      > "$OUT/prefill_steps.log" 2>&1 &
    (cd /tmp && python3 -P "$REPO/bench/sass_loop.py" > "$OUT/sass_loop.log" 2>&1) &
  fi
  wait
  tail -n 3 "$OUT"/tests_*.log
elif [ "$PLAN" = parts ]; then
  [ -n "${ROWS:-}" ] && run model_step.py --models 27b --rows "$ROWS" --tag model_step 2>&1 | tee "$OUT/model_step.log" \
    | grep -v '^{'
  run prefill_parts.py --deadline $(( start + ${PARTS_SECONDS:-300} )) ${PARTS_ARGS:-} 2>&1 | tee "$OUT/prefill_parts.log"
  echo "prefill parts done at +$(( $(date +%s) - start )) s"
  [ "${PROFILE:-0}" = 1 ] && run prefill_forms.py --profile --step-rows 4096 2>&1 | tee "$OUT/prefill_profile.log"
  test_set
  wait
  tail -n 3 "$OUT"/tests_*.log
elif [ "$PLAN" = kwidth ]; then
  (cd /tmp && python3 -P "$REPO/bench/sass_loop.py" --maxnreg 0,56 > "$OUT/sass_loop.log" 2>&1)
  echo "sass done at +$(( $(date +%s) - start )) s"
  run one_launch.py --variants ${VARIANTS:-8:0:0:0:2,8:0:0:0:1:0:0:1} --models ${MODELS:-27b,35b-a3b} \
    --rows ${VROWS:-1,4} --tag one_launch_kwidth --deadline $(( start + ${VARIANT_SECONDS:-220} )) 2>&1 \
    | grep -v '^{' > "$OUT/one_launch_kwidth.log"
  echo "variants done at +$(( $(date +%s) - start )) s"
  run model_step.py --rows ${ROWS:-1,4,16} --tag model_step --deadline $(( start + ${STEP_SECONDS:-330} )) 2>&1 \
    | grep -v '^{' > "$OUT/model_step.log"
elif [ "$PLAN" = moe ]; then
  tests ${TESTS:-"$REPO"/tests/kernels/test_triton_moe.py "$REPO"/tests/kernels/test_bound.py \
    "$REPO"/tests/kernels/test_triton_gpu.py}
  run model_step.py --models 35b-a3b --units --rows ${ROWS:-64,512,16,4096,4} --tag model_step_moe \
    --deadline $(( start + ${BENCH_SECONDS:-420} )) 2>&1 | tee "$OUT/model_step_moe.log" | grep -v '^{'
  echo "moe steps done at +$(( $(date +%s) - start )) s"
  run layers.py config --rows 1,4 --deadline $(( start + ${TOTAL_SECONDS:-530} )) 2>&1 | tee "$OUT/layers_config.log"
else
  tests ${TESTS:-"$REPO"/tests/kernels/test_triton_gpu.py "$REPO"/tests/kernels/test_triton_moe.py \
    "$REPO"/tests/kernels/test_bound.py}
  run model_step.py --deadline $(( start + ${BENCH_SECONDS:-400} )) ${ARGS:-} 2>&1 | tee "$OUT/model_step.log" \
    | grep -v '^{'
  echo "first run done at +$(( $(date +%s) - start )) s"
  EXL3_INT8_GEMV=0 run model_step.py --no-ours --tag model_step_int8off \
    --deadline $(( start + ${TOTAL_SECONDS:-540} )) ${ARGS:-} 2>&1 | tee "$OUT/model_step_int8off.log" | grep -v '^{'
fi
echo "all done at +$(( $(date +%s) - start )) s"
