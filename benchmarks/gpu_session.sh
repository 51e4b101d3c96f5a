#!/usr/bin/env bash
# One session on a lent GPU machine that has PyTorch and JAX but no Keras and no network
# (issue 32), within one device call. Run from the repository root with the wheels of
# keras 3.15.1, keras-hub 0.32.0 and what the machine lacks in .whl/ (see
# benchmarks/results/gpu.md):
#   OUT=/some/folder bash benchmarks/gpu_session.sh
# First the timings, one at a time on a quiet GPU:
#   probe.log        what `keras.ops.dot_product_attention` (the built-in's kernel) gives
#                    a query row with no visible key, on the CPU and on the GPU;
#   host-time.md     benchmarks/host_time.py: torch's host time per eager call, ours
#                    against the built-in, on tiny tensors on the GPU (HOST=0 skips it);
#   bench-torch.json benchmarks/gpu_bench.py with --profile (torch.profiler: GPU busy time);
#   bench-jax.json   benchmarks/gpu_bench.py, the long calls also under other policy
#                    rows (`--variant`: the GPU row of kernels/policy.py);
# then the tests, all at once (the timings are done): tests-BACKEND.xml (`pytest -m gpu
# tests/test_gpu.py`) and fast-BACKEND.log (the fast test modules on the GPU).
# session.log holds the machine, every part's exit status and its seconds.
# BACKENDS (torch jax; empty: no tests): the tests; BENCH_BACKENDS ($BACKENDS): the benchmarks, with
# BENCH_ARGS_torch / BENCH_ARGS_jax (gpu_bench.py run's arguments) and BENCH_TIMEOUT_torch
# / _jax (seconds); PACKED=1 adds benchmarks/packed.py (PACKED_TIMEOUT, 240 s) into
# $OUT/packed; PROBE=0 skips the probe; DEADLINE: seconds after which the tests are
# stopped (545); PY: the python (python3); NO_WHEELS: skip the install.
set -u
OUT=${OUT:-/tmp/gpu-session}
DEADLINE=${DEADLINE:-545}
BACKENDS=${BACKENDS-torch jax}
BENCH_BACKENDS=${BENCH_BACKENDS-$BACKENDS}
BENCH_ARGS_torch=${BENCH_ARGS_torch:---profile}
BENCH_ARGS_jax=${BENCH_ARGS_jax:---lengths 8192 32768 --variant fold_key_padding=()}
mkdir -p "$OUT"
START=$SECONDS
LOG=$OUT/session.log
PY=${PY:-$(command -v python3)}
if [ -z "${NO_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheels did not install" >>"$LOG"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
done_part() { echo "== $1: exit $2, at $((SECONDS - START)) s" >>"$LOG"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  KERAS_BACKEND=jax $PY -c "import keras, jax, torch; print(keras.__version__, jax.__version__, torch.__version__, jax.devices(), torch.cuda.get_device_name(0))"
} >>"$LOG" 2>&1

# What the built-in's kernel gives a row with no visible key: Keras's torch backend adds a
# large negative float mask and calls torch's scaled_dot_product_attention.
[ "${PROBE:-1}" = 0 ] || KERAS_BACKEND=torch timeout -k 5 60 $PY - >"$OUT/probe.log" 2>&1 <<'EOF'
import keras
import numpy as np

rng = np.random.default_rng(0)
for dtype, heads, head_dim, length in (
    ("float32", 2, 8, 6),
    ("float32", 4, 64, 128),
    ("bfloat16", 4, 64, 128),
    ("float16", 4, 64, 128),
):
    q, k, v = (rng.normal(size=(2, length, heads, head_dim)).astype("float32") for _ in range(3))
    mask = np.ones((2, 1, length, length), bool)
    mask[1, :, length // 2 :, :] = False  # batch 1's second half of queries: no key
    for device in ("cpu", "gpu"):
        with keras.device(device):
            x = [keras.ops.cast(t, dtype) for t in (q, k, v)]
            out = keras.ops.dot_product_attention(*x, mask=mask)
            out = keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))
        rows = out[1, length // 2 :]  # (rows, heads, head_dim)
        mean = v[1].mean(0)
        kind = (
            "nan" if np.isnan(rows).any()
            else "zero" if np.abs(rows).max() < 1e-6
            else "mean" if np.abs(rows - mean).max() < 3e-2
            else "other"
        )
        print(f"{dtype} heads={heads} head_dim={head_dim} T={length} {device}: {kind}; "
              f"first row {rows[0, 0, :4]}, values' mean {mean[0, :4]}")
EOF
done_part probe $?

[ "${HOST:-1}" = 0 ] || KERAS_BACKEND=torch timeout -k 5 90 $PY benchmarks/host_time.py \
  --rounds 4 --calls 100 >"$OUT/host-time.md" 2>>"$LOG"
done_part "host time" $?

for b in $BENCH_BACKENDS; do
  arguments=BENCH_ARGS_$b
  read -r -a extra <<<"${!arguments}"
  limit=BENCH_TIMEOUT_$b
  KERAS_BACKEND=$b timeout -s INT -k 10 "${!limit:-200}" $PY benchmarks/gpu_bench.py run \
    "${extra[@]}" --out "$OUT/bench-$b.json" >/dev/null 2>>"$LOG"
  done_part "bench $b" $?
done

# Packed sequences (issue 31) on the GPU, PACKED=1: benchmarks/packed.py on each
# benchmarked backend into $OUT/packed (packed.md: tokens/s, the device's peak memory).
if [ "${PACKED:-0}" = 1 ]; then
  timeout -s INT -k 10 "${PACKED_TIMEOUT:-240}" $PY benchmarks/packed.py \
    --backends $BENCH_BACKENDS --out "$OUT/packed" >"$OUT/packed.log" 2>&1
  done_part packed $?
fi

# The tests, all at once. Float64 references in the fast modules: JAX's matmuls in full
# float32 there (its GPU default is TF32), as torch's.
left=$((DEADLINE - (SECONDS - START)))
for b in $BACKENDS; do
  (KERAS_BACKEND=$b timeout -s INT -k 10 "$left" $PY -m pytest -q -m gpu -p no:cacheprovider \
     -rfE tests/test_gpu.py --junitxml="$OUT/tests-$b.xml" >/dev/null 2>&1
   done_part "gpu tests $b" $?) &
  workers=3
  [ "$b" = jax ] && workers=11
  (KERAS_BACKEND=$b JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 10 "$left" \
     $PY -m pytest -q -n "$workers" -p no:cacheprovider -rfE \
     tests/test_layer*.py tests/test_kernels.py tests/test_masks.py tests/test_cache.py \
     tests/test_trim.py tests/test_kernel_choice.py tests/test_numerics.py tests/test_rope.py >"$OUT/fast-$b.log" 2>&1
   done_part "fast modules $b" $?) &
done
wait
echo "== session: $((SECONDS - START)) s" >>"$LOG"
