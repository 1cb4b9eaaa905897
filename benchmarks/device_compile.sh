#!/usr/bin/env bash
# A second prepared GPU run: where the first step's compilation goes (trace, lowering,
# XLA compile, fused kernels) for the autoencoder's K-FAC step, its refresh and Adam.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index .devwheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
timeout 420 python3 benchmarks/compile_anatomy.py > "$OUT/compile_anatomy_gpu.txt" 2>&1
echo "compile_anatomy.py exit $?"; tail -20 "$OUT/compile_anatomy_gpu.txt"
