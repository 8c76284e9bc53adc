# Sourced (not run) by bench/*-device.sh at the repository root of an H200 call: exllamav3 1.6.5 and its
# deps from the carried .whl (add platformdirs there for test_selftest's CPU-library tests: exl3local.paths
# needs it and the device image lacks it), our package importable without an install (a shim maps
# exl3local.kernels to ./kernels and exl3local.plugin to ./plugin, as the editable install does), the prebuilt
# exllamav3 extension from .device-carry/ext if carried (../shared/device/README.md). Sets OUT, REPO, start;
# prints the GPU's clocks.
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
REPO=$PWD
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/shim /tmp/ext && cp -r exl3local /tmp/shim/ && ln -sfn "$REPO/kernels" /tmp/shim/exl3local/kernels
ln -sfn "$REPO/plugin" /tmp/shim/exl3local/plugin  # test_bound's reload test imports the plugin
ls .device-carry/ext/exllamav3_ext.so.part-* >/dev/null 2>&1 && cat .device-carry/ext/exllamav3_ext.so.part-* >/tmp/ext/exllamav3_ext.so
export PYTHONPATH=/tmp/shim:/tmp/site:/tmp/ext EXL3LOCAL_SHARED=$REPO/.device-carry/shared
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
