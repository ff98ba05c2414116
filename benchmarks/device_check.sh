#!/usr/bin/env bash
# One prepared accelerator check for jaxserve's Pallas attention (NVIDIA GPU; about 3-5 minutes).
#
#   benchmarks/device_check.sh               # on the GPU machine, from a copy of this repository
#   benchmarks/device_check.sh --cpu-smoke   # dry run: CPU, interpret mode, tiny model, .venv's python,
#                                            # installs nothing (~2 min on 2 cores)
#
# Steps, each time-boxed, each reported even when an earlier one failed:
#   1. environment: python, nvidia-smi, jax / jaxlib / plugin versions, jax.devices();
#   2. dependencies (see below);
#   3. tests/test_kernels_pallas.py with JAXSERVE_PALLAS_MODE=device: the shipped
#      Pallas GPU kernel compiled for the GPU (not interpret mode) against the
#      pure-JAX reference; junit XML in $OUT/kernel_tests.xml;
#   4. benchmarks/device_check.py: decode tok/s at 1 and 64 sequences on the
#      llama-1b shapes (random bfloat16 weights drawn on the device), with the
#      Pallas kernel and with the reference, and the share of HBM bandwidth;
#      $OUT/device_check.json (also printed).
# $OUT defaults to ./out/device_check; the whole log goes to $OUT/device_check.log.
#
# Dependencies. jaxserve needs jax (with a GPU backend), flax, numpy, jinja2,
# tokenizers and safetensors, plus pytest for step 3 (structlog is optional
# here: device_check.py stands in for it). The script uses $PYTHON, else
# python3, and runs jaxserve from this checkout (PYTHONPATH, no install).
#   - Already there (the H200 image: python3 with jax, the CUDA plugin, flax,
#     pytest...): nothing is installed.
#   - PyPI unreachable (the lent H200 reaches nothing): missing packages can
#     travel as wheels in ./.whl (see the device README: pip download
#     --only-binary ... -d .whl NAME==VERSION, carried with the run); they are
#     installed with --no-index into /tmp/device_check_site.
#   - PyPI reachable and jax without a GPU backend: a venv in
#     /tmp/device_check_venv gets `pip install -e . 'jax[cuda12]' pytest`.
#   - Neither: the script says what is missing and goes on; the tests and
#     the JSON then record the failures.
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO="$PWD"
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
OUT="${OUT:-$REPO/out/device_check}"
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[device_check.sh +$(( $(date +%s) - T0 ))s] $*"; }

if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ "$SMOKE" = 1 ] && [ -x "$REPO/.venv/bin/python" ]; then
  PY="$REPO/.venv/bin/python"  # the dry run uses the development venv
else
  PY="$(command -v python3 || command -v python)"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export JAXSERVE_CACHE_DIR="${JAXSERVE_CACHE_DIR:-/tmp/jaxserve-device-check}"
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  PALLAS_MODE=interpret
  PYTEST_TIMEOUT=400
  PY_TIMEOUT=300
  PY_ARGS=(--cpu-smoke)
else
  PALLAS_MODE=device
  PYTEST_TIMEOUT=120
  PY_TIMEOUT=170
  PY_ARGS=(--budget-s 150)
fi

say "step 1: environment (smoke=$SMOKE, python=$PY, out=$OUT)"
uname -a
"$PY" --version
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv

probe() {  # prints MISSING=<modules> and BACKEND=<jax backend or none>
  "$PY" - <<'EOF'
import importlib
missing = []
for name in ("jax", "jaxlib", "flax", "numpy", "jinja2", "tokenizers", "safetensors", "pytest"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
backend = "none"
if "jax" not in missing:
    try:
        import jax
        backend = jax.default_backend()
        print("JAX", jax.__version__, jax.devices())
    except Exception as exc:
        print("JAX_ERROR", repr(exc))
print("MISSING=" + ",".join(missing))
print("BACKEND=" + backend)
EOF
}

say "step 2: dependencies"
PROBE="$(probe 2>&1)"
echo "$PROBE"
MISSING="$(echo "$PROBE" | sed -n 's/^MISSING=//p')"
BACKEND="$(echo "$PROBE" | sed -n 's/^BACKEND=//p')"
WANT_BACKEND=gpu
if [ "$SMOKE" = 1 ]; then
  if [ -n "$MISSING" ] || [ "$BACKEND" != cpu ]; then
    say "WARNING: the dry run installs nothing; missing [$MISSING], backend '$BACKEND': set PYTHON to a python with jaxserve's dependencies"
  fi
elif [ -n "$MISSING" ] || [ "$BACKEND" != "$WANT_BACKEND" ]; then
  if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    say "installing carried wheels from .whl (no index)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/device_check_site "$REPO"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/device_check_site"
  elif "$PY" -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/pip/', timeout=8)" 2>/dev/null; then
    say "PyPI reachable: venv /tmp/device_check_venv with jaxserve and jax[cuda12]"
    "$PY" -m venv /tmp/device_check_venv \
      && timeout 600 /tmp/device_check_venv/bin/pip install -q -e "$REPO" 'jax[cuda12]' pytest pytest-timeout \
      && PY=/tmp/device_check_venv/bin/python
  else
    say "WARNING: missing [$MISSING], backend '$BACKEND' (want $WANT_BACKEND), no .whl and no PyPI: going on"
  fi
  probe
fi
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.default_backend(), jax.devices())" || true

say "step 3: tests/test_kernels_pallas.py (JAXSERVE_PALLAS_MODE=$PALLAS_MODE, timeout ${PYTEST_TIMEOUT}s)"
JAXSERVE_PALLAS_MODE="$PALLAS_MODE" timeout "$PYTEST_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_kernels_pallas.py --junitxml="$OUT/kernel_tests.xml" --durations=10
TESTS_RC=$?
say "kernel tests exit code $TESTS_RC"

say "step 4: benchmarks/device_check.py (timeout ${PY_TIMEOUT}s)"
timeout "$PY_TIMEOUT" "$PY" benchmarks/device_check.py --out "$OUT/device_check.json" \
  --junit "$OUT/kernel_tests.xml" --pytest-rc "$TESTS_RC" "${PY_ARGS[@]}"
BENCH_RC=$?
if [ ! -s "$OUT/device_check.json" ]; then
  echo "{\"fatal\": \"device_check.py exited $BENCH_RC before writing its JSON\", \"pytest_exit_code\": $TESTS_RC}" \
    >"$OUT/device_check.json"
  cat "$OUT/device_check.json"
fi
say "done: kernel tests rc=$TESTS_RC, device_check.py rc=$BENCH_RC; $OUT/device_check.json"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
