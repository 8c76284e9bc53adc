#!/usr/bin/env bash
# One H200 call for session 12's barrier change (kernels/triton_sync.py; docs/dev/notes/issue-21.md "Session 12").
# Carry: .whl and .device-carry as for bench/kernels-device.sh (the tests read shared/fixtures; exllamav3 is not
# needed). Logs and JSON go to $OUT.
#   1. the GPU tests of the kernels (the self-test's repeats over NaN included), and the sm_90 compile of every
#      kernel (tests/kernels/test_compile_targets.py, gpu);
#   2. bench/barrier_ab.py with the kernels as committed (new), with a copy in which triton_sync's calls are
#      tl.debug_barrier() / nothing again (old: the code before), and new once more (the run's drift): graph µs per
#      27B linear (two launches, split-K and unsplit) and per one-launch shape, decode rows 1/4/16; the outputs of old
#      and new must hash alike.
set -u
source bench/device-setup.sh
(cd /tmp && timeout ${TEST_SECONDS:-240} python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$REPO" \
  -c "$REPO/pyproject.toml" "$REPO"/tests/kernels/test_triton_gpu.py "$REPO"/tests/kernels/test_bound.py \
  "$REPO"/tests/kernels/test_triton_moe.py "$REPO"/tests/kernels/test_selftest.py \
  "$REPO"/tests/kernels/test_compile_targets.py::test_every_kernel_compiles_for_sm90 \
  2>&1 | tail -15 | tee "$OUT/tests.log")
echo "tests done at +$(( $(date +%s) - start )) s"
mkdir -p /tmp/shim_old && cp -r /tmp/shim/exl3local /tmp/shim_old/ && rm /tmp/shim_old/exl3local/kernels
cp -r "$REPO/kernels" /tmp/kernels_old && ln -sfn /tmp/kernels_old /tmp/shim_old/exl3local/kernels
sed -i -e 's/cta_barrier([^)]*)/tl.debug_barrier()/' -e 's/^\( *\)global_fence([^)]*).*$/\1pass/' \
  /tmp/kernels_old/triton_fused.py /tmp/kernels_old/triton_gemv.py /tmp/kernels_old/triton_moe.py
echo "triton_sync calls left in the old copy (0 expected): $(cat /tmp/kernels_old/triton_{fused,gemv,moe}.py | grep -c "cta_barrier(\|global_fence(")"
ab() {
  (cd /tmp && PYTHONPATH=$1:/tmp/site:/tmp/ext python3 -P "$REPO/bench/barrier_ab.py" --tag "$2" --out "$OUT" \
    --deadline $(( start + $3 )) 2>&1 | tee "$OUT/$2.log")
  echo "$2 done at +$(( $(date +%s) - start )) s"
}
ab /tmp/shim new ${NEW_SECONDS:-400}
ab /tmp/shim_old old ${OLD_SECONDS:-480}
ab /tmp/shim new2 ${TOTAL_SECONDS:-560}
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
runs = {tag: {(r["k"], r["n"], r["bits"], r["m"]): r for r in json.loads(Path(sys.argv[1], f"{tag}.json").read_text())}
        for tag in ("new", "old", "new2") if Path(sys.argv[1], f"{tag}.json").exists()}
print(f"{'shape':>12} {'K':>2} {'M':>3} | {'new':>7} {'old':>7} {'new2':>7} | new/old  outputs")
for key, row in runs.get("new", {}).items():
    old, new2 = runs.get("old", {}).get(key), runs.get("new2", {}).get(key)
    us = [row["graph_us"], old["graph_us"] if old else float("nan"), new2["graph_us"] if new2 else float("nan")]
    same = "same" if old and old["out"] == row["out"] else "DIFFER" if old else "-"
    print(f"{key[0]:>5}x{key[1]:<6} {key[2]:>2} {key[3]:>3} | {us[0]:7.1f} {us[1]:7.1f} {us[2]:7.1f} | "
          f"{us[0] / us[1]:6.3f}   {same}")
EOF
echo "all done at +$(( $(date +%s) - start )) s"
