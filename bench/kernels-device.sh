#!/usr/bin/env bash
# One H200 call (docs/PERF.md): build exllamav3's CUDA extension in the background while our kernels are
# tested and timed alone, then bench/kernels.py with exllamav3 in the same process as ours. Carry: .whl
# (exllamav3 + deps, device README's pip download flags) and .device-carry (shared/fixtures/exl3; and
# ext/exllamav3_ext.so.part-* from an earlier run's $OUT, which skips the ~5 min build).
set -u
source bench/device-setup.sh
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14
BUILD=
if [ ! -f /tmp/ext/exllamav3_ext.so ]; then
  (cd /tmp && setsid nohup python3 -c "import exllamav3.ext" >"$OUT/exl3_build.log" 2>&1 </dev/null) &
  BUILD=$!
fi
bench() { (cd /tmp && python3 -P "$REPO/bench/kernels.py" --out "$OUT" "$@"); }
(cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  "$REPO"/tests/kernels/test_triton_gpu.py "$REPO"/tests/kernels/test_triton_moe.py "$REPO"/tests/kernels/test_bound.py 2>&1 | tail -15)
echo "tests done at +$(( $(date +%s) - start )) s"
# While nvcc runs: our kernels alone (config sweep; also compiles what the timed run needs).
[ -n "$BUILD" ] && bench --no-exl3 --tag sweep --sections breakdown,decode --deadline $(( start + 290 )) >"$OUT/sweep.log" 2>&1
if [ -n "$BUILD" ]; then
  while kill -0 "$BUILD" 2>/dev/null; do sleep 5; done
  echo "exllamav3 build finished at +$(( $(date +%s) - start )) s"; tail -3 "$OUT/exl3_build.log"
  so=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  [ -n "$so" ] && ls -la "$so" && split -b 15M -d "$so" "$OUT/exllamav3_ext.so.part-"
fi
bench --deadline $(( start + ${BENCH_SECONDS:-560} )) --sections ${SECTIONS:-correct,decode,prefill,moe,other} "$@" 2>&1 | tee "$OUT/bench.log"
