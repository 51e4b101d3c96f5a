#!/usr/bin/env bash
# One session on a lent GPU machine that has PyTorch and JAX but no Keras and no network
# (issue 32). Run from the repository root with the wheels of keras 3.15.1, keras-hub
# 0.32.0 and what the machine lacks in .whl/ (see benchmarks/results/README.md):
#   OUT=/some/folder bash benchmarks/gpu_session.sh
# It writes, into $OUT: gpu.log (the machine, `make gpu` for torch and jax: the `gpu`
# tests and benchmarks/gpu_bench.py), gpu-DATE.md and raw/ (the report and its inputs),
# and fast-BACKEND.log (the fast test modules under each backend, on the GPU).
# GPU_BACKENDS (torch jax): `make gpu`; TEST_BACKENDS (none): the `gpu` tests alone;
# FAST_BACKENDS (torch jax): the fast modules; *_TIMEOUT: seconds for each part.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=$(command -v python3)
START=$SECONDS
{
  date -u
  nvidia-smi
  $PY -c "import keras, jax, torch; print(keras.__version__, jax.__version__, torch.__version__, jax.devices(), torch.cuda.get_device_name(0))"
  timeout -s INT -k 10 "${GPU_TIMEOUT:-330}" \
    make gpu BIN="$(dirname "$PY")" GPU_BACKENDS="${GPU_BACKENDS:-torch jax}" GPU_OUT="$OUT" \
    GPU_BENCH_ARGS="${GPU_BENCH_ARGS:-}"
  echo "make gpu: exit $?, $((SECONDS - START)) s"
  for b in ${TEST_BACKENDS:-}; do
    KERAS_BACKEND=$b timeout -s INT -k 10 "${TEST_TIMEOUT:-90}" $PY -m pytest -q -m gpu \
      -p no:cacheprovider -rfE tests/test_gpu.py --junitxml="$OUT/raw/tests-$b.xml"
    echo "$b gpu tests: exit $?, $((SECONDS - START)) s"
  done
} >"$OUT/gpu.log" 2>&1
# Float64 references: JAX's matmuls in full float32 (its GPU default is TF32), as torch's.
for b in ${FAST_BACKENDS:-torch jax}; do
  KERAS_BACKEND=$b JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 10 "${FAST_TIMEOUT:-70}" \
    $PY -m pytest -v -n "${FAST_WORKERS:-8}" -p no:cacheprovider -rfE \
    tests/test_layer*.py tests/test_kernels.py tests/test_masks.py tests/test_cache.py \
    >"$OUT/fast-$b.log" 2>&1
  echo "exit $?, $((SECONDS - START)) s" >>"$OUT/fast-$b.log"
done
