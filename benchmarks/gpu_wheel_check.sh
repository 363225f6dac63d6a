#!/usr/bin/env bash
# jax_blink installed as GPU users install it, on the GPU machine (issue 30): a wheel in a fresh
# environment with no CUDA toolkit in sight, and a source build that takes CUDA from pip.
#
#   bash benchmarks/gpu_wheel_check.sh                      # builds a wheel here first (step wheel)
#   WHEEL=/path/jax_blink-0.1.0-cp312-...whl bash benchmarks/gpu_wheel_check.sh   # a given wheel
#
# Run from the repository root; logs under $OUT/wheel_check ($OUT defaults to ./gpu_out), the
# summary in summary.log. Each step has its own time limit (wheel 420 s, pytest 240 s, ...): wrap
# the whole in `timeout` below the caller's limit.
# Steps (STEPS, default "wheel install gputests pipcuda"):
#   wheel     builds a wheel of this checkout for the image's Python with the system toolkit (the
#             one step that sees it): WHEEL_ARCHS, default all, as shipped. Against the XLA FFI
#             headers in FFI_HEADERS, default .carry/xla-ffi-jax-0.10.2 (jax 0.10.2's, FFI API 0.3,
#             as a shipped wheel; copy them there from jaxlib/include of jax 0.10.2) where that
#             exists, else the image's jax's: the install below then checks that a newer jax takes
#             a handler of an older FFI API. Runs beside pipcuda's build (both only compile).
#             Skipped when WHEEL is given.
#   install   a fresh venv holding the wheel; the image's site-packages (jax, jaxlib and its CUDA
#             plugin, numpy, ...: its sys.path entries that end in site-packages or dist-packages)
#             are added to it as plain paths (a .pth listing them), which acts
#             like `python3 -m venv --system-site-packages` except that .pth files there are not run:
#             an editable jax_blink of the checkout in the image (benchmarks/gpu_session.sh's build)
#             stays out. Then, with the toolkit hidden: which copy imports, the executors,
#             device_problem(0), the CPU executor against lax, `jax-blink env`.
#   gputests  python -m pytest -q -x tests/gpu in that venv, from a copy of tests/ outside the
#             checkout, so that the installed wheel is what is tested (a WHEEL given from elsewhere
#             must be of this checkout's sources: the tests import its modules).
#   pipcuda   pip install --no-build-isolation of this checkout into a second venv, the toolkit
#             hidden, so that CMake must find pip's nvidia-cuda-nvcc (which jax[cuda13] installs);
#             JAX_BLINK_CUDA=ON (fail rather than build CPU only) and one architecture (PIPCUDA_ARCHS,
#             default 90); then the smoke test on GPU 0. Skipped, saying why, where the image has no
#             complete pip toolkit: the wheels (nvidia-cuda-nvcc, -nvvm, -runtime, -crt: about
#             100 MiB) are more than the working tree may carry.
# "Hidden": every PATH entry that holds nvcc or names a cuda folder is dropped, and CUDA_HOME,
# CUDA_PATH, CUDA_ROOT and CUDACXX are unset. LD_LIBRARY_PATH is kept (jax's own CUDA may need it);
# the CUDA executor links its runtime statically and needs only the driver (its NEEDED libraries
# are logged).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$(pwd)
[ -f "$REPO/pyproject.toml" ] && [ -f "$REPO/tests/helpers/wheel_smoke.py" ] \
  || { echo "gpu_wheel_check.sh: run from the repository root" >&2; exit 2; }
STEPS=${STEPS:-"wheel install gputests pipcuda"}
for step in $STEPS; do  # every name checked before anything runs: a typo must not cost a GPU call
  [[ " wheel install gputests pipcuda " == *" $step "* ]] \
    || { echo "gpu_wheel_check.sh: unknown step '$step'; steps: wheel install gputests pipcuda" >&2; exit 2; }
done
OUT=${OUT:-./gpu_out}/wheel_check; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-/tmp/jax_blink_wheel_check}; rm -rf "$WORK"; mkdir -p "$WORK"
PY=$(command -v python3)  # the image's Python, resolved before PATH is narrowed
WHEEL_ARCHS=${WHEEL_ARCHS:-all}
FFI_HEADERS=${FFI_HEADERS:-$REPO/.carry/xla-ffi-jax-0.10.2}
PIPCUDA_ARCHS=${PIPCUDA_ARCHS:-90}
log() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.log"; }
note() { echo "$*" | tee -a "$OUT/summary.log"; }

# PATH without the system toolkit, and the variables that name it unset.
HIDDEN_PATH=
IFS=: read -ra path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do
  if [ -x "$d/nvcc" ] || [[ "$d" == *cuda* ]]; then note "hidden from PATH: $d"; continue; fi
  HIDDEN_PATH=${HIDDEN_PATH:+$HIDDEN_PATH:}$d
done
no_toolkit() { env -u CUDA_HOME -u CUDA_PATH -u CUDA_ROOT -u CUDACXX PATH="$HIDDEN_PATH" "$@"; }
if no_toolkit bash -c 'command -v nvcc' >/dev/null; then
  note "FAILED: nvcc is still on the narrowed PATH: $(no_toolkit bash -c 'command -v nvcc')"; exit 1
fi
note "python $(timeout 60 "$PY" -V 2>&1) at $PY; jax $(timeout 120 "$PY" -c 'import jax; print(jax.__version__)' 2>&1 | tail -1)"
note "system nvcc (hidden below): $(command -v nvcc || echo none on PATH) $(nvcc --version 2>/dev/null | tail -1)"

# A venv that sees the image's packages as plain paths (see "install" above); ortools from .whl/
# where the image has none.
make_venv() {
  local venv=$1
  timeout 120 "$PY" -m venv "$venv" || return 1
  timeout 60 "$PY" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    > "$(timeout 60 "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image-site-packages.pth"
  if ! timeout 120 "$venv/bin/python" -c "import ortools" 2>/dev/null && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    timeout 120 "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile "$REPO"/.whl/*.whl || return 1
  fi
}

# The image's pip toolkit (nvidia/cu13 of nvidia-cuda-nvcc and what it needs), or what it lacks.
pip_toolkit_problem() {
  timeout 60 "$PY" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = [os.path.join(p, "cu13") for p in (spec.submodule_search_locations if spec else [])]
need = {"nvidia-cuda-nvcc": "bin/nvcc", "nvidia-nvvm": "nvvm/bin/cicc",
        "nvidia-cuda-runtime": "lib/libcudart_static.a", "nvidia-cuda-crt": "include/crt/host_config.h"}
for root in roots:
    missing = [name for name, path in need.items() if not os.path.exists(os.path.join(root, path))]
    if "nvidia-cuda-nvcc" not in missing:
        print(f"lacks {' '.join(missing)} in {root}" if missing else "", end="")
        break
else:
    print("has no nvidia-cuda-nvcc (nvidia/cu13/bin/nvcc) in its site-packages", end="")
EOF
}

PIPCUDA_PID=
start_pipcuda_build() {
  local problem; problem=$(pip_toolkit_problem)
  if [ -n "$problem" ]; then
    note "pipcuda: SKIPPED: the image $problem (the pip toolkit's wheels, ~100 MiB, cannot travel with the tree)"
    return 1
  fi
  make_venv "$WORK/pipcuda-venv" || { note "pipcuda: FAILED: no venv"; return 1; }
  # A build folder of its own, never the checkout's build/; the install goes into the venv.
  ( cd "$WORK" && no_toolkit timeout 420 "$WORK/pipcuda-venv/bin/python" -m pip install -v --no-build-isolation \
      --no-deps -Cbuild-dir="$WORK/pipcuda-build" -Ccmake.define.JAX_BLINK_CUDA=ON \
      -Ccmake.define.JAX_BLINK_CUDA_ARCHS="$PIPCUDA_ARCHS" "$REPO" ) > "$OUT/pipcuda_build.log" 2>&1 &
  PIPCUDA_PID=$!
}

# The smoke test, from a folder outside the checkout, with the toolkit hidden.
smoke() {  # smoke VENV LOGNAME ARGS...
  local venv=$1 name=$2; shift 2
  mkdir -p "$WORK/run"
  ( cd "$WORK/run" && no_toolkit timeout 180 "$venv/bin/python" "$REPO/tests/helpers/wheel_smoke.py" \
      --not-under "$REPO" --under "$venv" "$@" ) > "$OUT/$name.log" 2>&1
  local rc=$?; tail -8 "$OUT/$name.log" | tee -a "$OUT/summary.log"; return $rc
}

t0=$(date +%s)
if [[ " $STEPS " == *" pipcuda "* ]]; then log "pipcuda: build starts (JAX_BLINK_CUDA_ARCHS=$PIPCUDA_ARCHS)"; start_pipcuda_build; fi

if [[ " $STEPS " == *" wheel "* ]] && [ -z "${WHEEL:-}" ]; then
  ffi=(); headers="those of the jax in the image"
  if [ -f "$FFI_HEADERS/xla/ffi/api/c_api.h" ]; then ffi=(-Ccmake.define.XLA_FFI_INCLUDE_DIR="$FFI_HEADERS"); headers=$FFI_HEADERS; fi
  log "wheel: building (JAX_BLINK_CUDA_ARCHS=$WHEEL_ARCHS, system toolkit, FFI headers: $headers)"
  w0=$(date +%s)
  timeout 420 "$PY" -m pip wheel -v --no-deps --no-build-isolation -w "$WORK/dist" -Cbuild-dir="$WORK/wheel-build" \
    -Ccmake.define.JAX_BLINK_CUDA=ON -Ccmake.define.JAX_BLINK_CUDA_ARCHS="$WHEEL_ARCHS" "${ffi[@]}" "$REPO" \
    > "$OUT/wheel_build.log" 2>&1 || { note "wheel: FAILED (rc $?)"; tail -30 "$OUT/wheel_build.log"; exit 1; }
  WHEEL=$(ls "$WORK"/dist/jax_blink-*.whl | head -1)
  note "wheel: $(basename "$WHEEL"), $(du -k "$WHEEL" | cut -f1) KiB, built in $(( $(date +%s) - w0 )) s"
  grep -m2 -E "XLA FFI headers|executors built" "$OUT/wheel_build.log" | tee -a "$OUT/summary.log"
  if timeout 60 "$PY" -m auditwheel --version >/dev/null 2>&1; then
    timeout 60 "$PY" -m auditwheel show "$WHEEL" 2>&1 | tee -a "$OUT/summary.log"
  else
    note "wheel: auditwheel is not in the image (checked on the CPU machine; see docs/gpu.md)"
  fi
fi

if [[ " $STEPS " == *" install "* || " $STEPS " == *" gputests "* ]]; then
  [ -n "${WHEEL:-}" ] && [ -f "$WHEEL" ] || { note "install: FAILED: no wheel (WHEEL=${WHEEL:-unset})"; exit 1; }
  log "install: $(basename "$WHEEL") into a fresh venv, no toolkit on PATH"
  make_venv "$WORK/venv" || { note "install: FAILED: no venv"; exit 1; }
  no_toolkit timeout 180 "$WORK/venv/bin/python" -m pip install --no-deps --no-index "$WHEEL" > "$OUT/install.log" 2>&1 \
    || { note "install: FAILED"; tail -20 "$OUT/install.log"; exit 1; }
  so=$(ls "$WORK"/venv/lib/python3*/site-packages/jax_blink/_blink_cuda*.so 2>/dev/null | head -1)
  [ -n "$so" ] && note "installed _blink_cuda needs: $(objdump -p "$so" 2>/dev/null | awk '/NEEDED/ {print $2}' | tr '\n' ' ')"
  smoke "$WORK/venv" smoke_wheel --gpu || note "install: smoke test FAILED"
  ( cd "$WORK/run" && no_toolkit timeout 120 "$WORK/venv/bin/jax-blink" env ) > "$OUT/env_wheel.txt" 2>&1
  note "install: jax-blink env rc=$? (whole output: env_wheel.txt)"; grep -A3 "CUDA executor" "$OUT/env_wheel.txt" | head -6 | tee -a "$OUT/summary.log"
fi

if [[ " $STEPS " == *" gputests "* ]]; then
  log "gputests: pytest -q -x tests/gpu against the installed wheel"
  rm -rf "$WORK/run/tests"; cp -r "$REPO/tests" "$WORK/run/tests"; cp "$REPO/pyproject.toml" "$WORK/run/"  # pytest's markers
  ( cd "$WORK/run" && no_toolkit timeout 300 "$WORK/venv/bin/python" -c \
      "import jax_blink; assert '$WORK/venv' in jax_blink.__file__, jax_blink.__file__" \
    && no_toolkit timeout 240 "$WORK/venv/bin/python" -m pytest -q -x -p no:cacheprovider tests/gpu ) \
    > "$OUT/pytest_gpu_wheel.log" 2>&1
  note "gputests: rc=$?"; tail -4 "$OUT/pytest_gpu_wheel.log" | tee -a "$OUT/summary.log"
fi

if [ -n "$PIPCUDA_PID" ]; then
  log "pipcuda: waiting for the build"
  wait "$PIPCUDA_PID"; rc=$?
  grep -E "jax_blink: (no nvcc|executors built)|CUDA compiler identification" "$OUT/pipcuda_build.log" | tee -a "$OUT/summary.log"
  if [ $rc -ne 0 ]; then
    note "pipcuda: build FAILED (rc $rc)"; tail -30 "$OUT/pipcuda_build.log"
  elif ! grep -q "taking .*/nvidia/cu13/bin/nvcc" "$OUT/pipcuda_build.log"; then
    note "pipcuda: FAILED: the build did not take pip's nvcc (see pipcuda_build.log)"
  else
    smoke "$WORK/pipcuda-venv" smoke_pipcuda --gpu || note "pipcuda: smoke test FAILED"
  fi
fi
log "done in $(( $(date +%s) - t0 )) s"
