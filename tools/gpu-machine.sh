#!/usr/bin/env bash
# The GPU checks on a bare GPU machine (the device tool's H200): its image has python3 with a CUDA torch, cupy,
# cmake, ninja and nanobind, and reaches no package registry. Run from the checkout's root there:
#
#   tools/gpu-machine.sh [gpu_check.py args]
#
# It uses what the call carried beside the checkout, each optional (without it the checks that need it SKIP, saying so):
#   .whl/    wheels for that machine's python (kvikio-cu13, libkvikio-cu13, rapids-logger), installed to /tmp/site;
#            fetch them here with tools/gpu-machine.sh --fetch (pip download for cp312, manylinux x86-64);
#   .uring/  Debian's liburing-dev and liburing2 .debs (apt-get download), so the native engine has io_uring.
# Then it builds sfstore's native helper for that python (cmake, into sfstore/) and runs tools/gpu_check.py (the
# tests marked gpu, then the gpu bench suite). Logs and the JSON go to $OUT (the device tool's folder), else
# /tmp/gpu-out. The exit status is gpu_check's.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
  plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64; do plat+=(--platform "$p"); done
  mkdir -p .whl .uring
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    "kvikio-cu13==26.10.*" "libkvikio-cu13==26.10.*" "rapids-logger==0.3.*" || exit 1
  (cd .uring && apt-get download liburing-dev liburing2) || exit 1
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; printf '/.whl/\n/.uring/\n' >>.git/info/exclude; }
  echo "fetched: carry .whl and .uring in the device call"
  exit 0
fi

say() { echo "==> gpu-machine: $*"; }
export PYTHONUNBUFFERED=1
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1); $($PY -V 2>&1)"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} && say "installed $(ls .whl | tr '\n' ' ')"
fi
prefix=()
if ls .uring/*.deb >/dev/null 2>&1; then
  for f in .uring/*.deb; do dpkg -x "$f" /tmp/uring; done
  prefix=(-DCMAKE_PREFIX_PATH=/tmp/uring/usr)
  export LD_LIBRARY_PATH=/tmp/uring/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
say "building the native helper"
if cmake -S native -B /tmp/sfstore-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
     -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" "${prefix[@]}" >"$OUT/native-build.log" 2>&1 \
   && cmake --build /tmp/sfstore-native >>"$OUT/native-build.log" 2>&1; then
  cp /tmp/sfstore-native/_native*.so sfstore/
else
  tail -20 "$OUT/native-build.log"; say "native build FAILED (the checks that need it SKIP)"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import sfstore, sfstore._native as n; print("sfstore", sfstore.__version__, "native", n.__file__)'

say "tools/gpu_check.py $*"
# gpu_check runs the tests marked gpu (pytest -m gpu) and the gpu bench suite, each within its budget
"$PY" tools/gpu_check.py --json "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
