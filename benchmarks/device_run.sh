#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see docs/benchmarks.md, "On an H100"):
# seconds to a target loss against the first-order methods, and step times against
# Adam, on the deep autoencoder. The machine has JAX with CUDA; dm-haiku, jmp and
# mlxtend come as wheels in .devwheels/ (pip download --no-deps -d .devwheels
# dm-haiku jmp mlxtend). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index .devwheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
timeout 150 python3 benchmarks/autoencoder.py --batch-sizes 1000 4000 \
  --out "$OUT/autoencoder_gpu.json" > "$OUT/autoencoder_gpu.txt" 2>&1
echo "autoencoder.py exit $?"; tail -25 "$OUT/autoencoder_gpu.txt"
timeout 330 python3 benchmarks/time_to_target.py --steps 300 \
  --out "$OUT/time_to_target_gpu.json" > "$OUT/time_to_target_gpu.txt" 2>&1
echo "time_to_target.py exit $?"; tail -45 "$OUT/time_to_target_gpu.txt"
