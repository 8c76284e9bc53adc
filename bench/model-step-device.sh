#!/usr/bin/env bash
# One H200 call (docs/PERF.md "Model step"): the GPU tests, then bench/model_step.py twice in separate
# processes (exllamav3 reads EXL3_INT8_GEMV once per process): ours + exllamav3's default, then exllamav3
# with EXL3_INT8_GEMV=0. Carry: .whl (exllamav3 1.6.5 + deps) and .device-carry (ext/exllamav3_ext.so.part-*,
# the prebuilt extension; shared/fixtures/exl3 for the tests). Logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
REPO=$PWD
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# exl3local.kernels maps to ./kernels only in an editable install; a shim package does the same here.
mkdir -p /tmp/shim /tmp/ext && cp -r exl3local /tmp/shim/ && ln -sfn "$REPO/kernels" /tmp/shim/exl3local/kernels
cat .device-carry/ext/exllamav3_ext.so.part-* >/tmp/ext/exllamav3_ext.so || exit 1
export PYTHONPATH=/tmp/shim:/tmp/site:/tmp/ext EXL3LOCAL_SHARED=$REPO/.device-carry/shared
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
(cd /tmp && timeout ${TEST_SECONDS:-150} python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$REPO" \
  -c "$REPO/pyproject.toml" ${TESTS:-"$REPO"/tests/kernels/test_triton_gpu.py "$REPO"/tests/kernels/test_triton_moe.py \
  "$REPO"/tests/kernels/test_bound.py} 2>&1 | tail -15 | tee "$OUT/tests.log")
echo "tests done at +$(( $(date +%s) - start )) s"
run() { (cd /tmp && python3 -P "$REPO/bench/model_step.py" --out "$OUT" "$@"); }
run --deadline $(( start + ${BENCH_SECONDS:-400} )) ${ARGS:-} 2>&1 | tee "$OUT/model_step.log" | grep -v '^{'
echo "first run done at +$(( $(date +%s) - start )) s"
EXL3_INT8_GEMV=0 run --no-ours --tag model_step_int8off --deadline $(( start + ${TOTAL_SECONDS:-540} )) ${ARGS:-} 2>&1 \
  | tee "$OUT/model_step_int8off.log" | grep -v '^{'
echo "all done at +$(( $(date +%s) - start )) s"
