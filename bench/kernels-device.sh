#!/usr/bin/env bash
# One H200 call (docs/PERF.md): build exllamav3's CUDA extension in the background, run the Triton kernel
# tests on the GPU meanwhile, then bench/kernels.py. Carry: .whl (exllamav3 + deps, device README's pip
# download flags), .device-carry (shared/fixtures/exl3, and exllamav3_ext.so once a run has built it).
set -u
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# exl3local.kernels maps to ./kernels only in an editable install; a shim package does the same here.
mkdir -p /tmp/shim && cp -r exl3local /tmp/shim/ && ln -sfn "$REPO/kernels" /tmp/shim/exl3local/kernels
mkdir -p .device-carry/ext
export PYTHONPATH=/tmp/shim:/tmp/site:$REPO/.device-carry/ext EXL3LOCAL_SHARED=$REPO/.device-carry/shared
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
BUILD=
if [ ! -f .device-carry/ext/exllamav3_ext.so ]; then
  (cd /tmp && setsid nohup python3 -c "import exllamav3.ext" >"$OUT/exl3_build.log" 2>&1 </dev/null) &
  BUILD=$!
fi
start=$(date +%s)
deadline=$(( start + ${BENCH_SECONDS:-540} ))
(cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  "$REPO"/tests/kernels/test_triton_*.py 2>&1 | tail -15)
echo "tests took $(( $(date +%s) - start )) s"
# While nvcc runs: our kernels alone (config sweep), so the build's wait is not wasted.
[ -n "$BUILD" ] && (cd /tmp && python3 -P "$REPO/bench/kernels.py" --out "$OUT" --no-exl3 --tag sweep \
  --sections breakdown --deadline $(( start + 330 )) 2>&1 | tee "$OUT/sweep.log")
if [ -n "$BUILD" ]; then
  while kill -0 "$BUILD" 2>/dev/null; do sleep 5; done
  echo "exllamav3 build finished after $(( $(date +%s) - start )) s"; tail -3 "$OUT/exl3_build.log"
  so=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  [ -n "$so" ] && ls -la "$so" && cp "$so" "$OUT/exllamav3_ext.so"
fi
cd /tmp && python3 -P "$REPO/bench/kernels.py" --out "$OUT" --deadline $deadline "$@" 2>&1 | tee "$OUT/bench.log"
