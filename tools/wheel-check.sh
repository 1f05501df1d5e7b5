#!/usr/bin/env bash
# sfstore as a user installs it: a wheel built from this checkout, installed into a fresh venv that already has
# its own torch, then the demo, an import of every face, the probe, the config check and README's quick starts
# (twice). CI runs it after `tools/dev.sh test` (.ci/run).
#
#   tools/wheel-check.sh [EXTRAS]     EXTRAS: the extras installed with the wheel (default: data,hf,lightning)
#
# Everything lives in a temporary directory, removed afterwards (KEEP=1 keeps it): the wheel, its build tree, the
# venv, the demo's data, HOME and XDG_* of the run steps, so nothing of the checkout's .venv, build/ or the user's
# data directory is used or touched. The user's own torch is stood in for by the CPU torch the dev constraints pin
# (tools/constraints-dev.txt), installed first; the wheel and its extras are installed WITHOUT those constraints
# (as a user would) and must leave that torch as it is. Loud: each step says what it does and how long it took;
# any failure stops the check with a non-zero exit. A few minutes with pip's cache warm.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
EXTRAS=${1:-data,hf,lightning}
PY=${PYTHON:-python3}
CONSTRAINTS=$ROOT/tools/constraints-dev.txt

. tools/lib.sh

W=$(mktemp -d "${TMPDIR:-/tmp}/sfstore-wheel-check.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then trap 'say "kept $W"' EXIT; else trap 'rm -rf "$W"' EXIT; fi
FRESH=$W/venv
mkdir -p "$W/wheel" "$W/run" "$W/home" "$W/data" "$W/config" "$W/demo-data"
TIMES=()
T0=$SECONDS

step() {  # step N WHAT: announce a step; `done_step` closes it with its time
  STEP_NAME="$1. $2"
  STEP_START=$SECONDS
  say "wheel-check step $STEP_NAME"
}
done_step() {
  local t=$((SECONDS - STEP_START))
  TIMES+=("$(printf '%4d s  %s' "$t" "$STEP_NAME")")
  say "  ok ($t s)"
}
fail() {
  say "wheel-check FAILED at step $STEP_NAME: $*"
  exit 1
}
# The run steps: from a directory outside the checkout (no ./sfstore to import, no ./sfstore.toml), with a HOME,
# data and config directories of their own and no SFSTORE_* variable: the embedded default, as a new user has it.
user() {
  (cd "$W/run" && env $(env | sed -n 's/^\(SFSTORE_[A-Za-z0-9_]*\)=.*/-u \1/p') HOME="$W/home" \
    XDG_DATA_HOME="$W/data" XDG_CONFIG_HOME="$W/config" PATH="$FRESH/bin:$PATH" "$@")
}

step 1 "create a fresh venv ($FRESH, with $PY)"
"$PY" -m venv "$FRESH"
"$FRESH/bin/python" -c 'import sys; print(f"python {sys.version.split()[0]} at {sys.prefix}")'
done_step

step 2 "build sfstore's wheel from $ROOT (pip wheel --no-deps, build isolation, its own build tree)"
# build-dir: a tree of this check's own, so the checkout's build/ (and its in-place helper) plays no part
retry "$FRESH/bin/pip" wheel -q --no-deps -w "$W/wheel" -C build-dir="$W/build" "$ROOT"
WHEEL=$(ls "$W"/wheel/sfstore-*.whl)
natives=$("$FRESH/bin/python" -c 'import sys, zipfile
print(len([n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith("sfstore/_native")
           and n.endswith(".so")]))' "$WHEEL")
[ "$natives" = 1 ] || fail "the wheel holds $natives native helpers (sfstore/_native*.so), not 1"
say "  $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
done_step

step 3 "install the user's own torch (and numpy) first (stand-in: the CPU torch of tools/constraints-dev.txt)"
retry "$FRESH/bin/pip" install -q -c "$CONSTRAINTS" torch numpy
TORCH_BEFORE=$("$FRESH/bin/python" -c 'import torch; print(torch.__version__)')
say "  torch $TORCH_BEFORE"
done_step

step 4 "install the wheel with [$EXTRAS], no constraints on sfstore's side; the user's torch must stay"
# A dry run first: a resolution that would replace torch fails here, before pip downloads gigabytes of it.
"$FRESH/bin/pip" install -q --dry-run --report "$W/report.json" "$WHEEL[$EXTRAS]"
changed=$("$FRESH/bin/python" -c 'import json, sys
meta = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
print(" ".join(m["name"] + "==" + m["version"] for m in meta
               if m["name"].lower() == "torch" or m["name"].lower().startswith("nvidia-")))' "$W/report.json")
[ -z "$changed" ] || fail "installing sfstore[$EXTRAS] would replace the user's torch $TORCH_BEFORE: $changed"
retry "$FRESH/bin/pip" install -q "$WHEEL[$EXTRAS]"
TORCH_AFTER=$("$FRESH/bin/python" -c 'import torch; print(torch.__version__)')
[ "$TORCH_AFTER" = "$TORCH_BEFORE" ] || fail "torch changed from $TORCH_BEFORE to $TORCH_AFTER"
"$FRESH/bin/pip" list --format=freeze 2>/dev/null | grep -i -E '^(sfstore|torch|transformers|lightning|accelerate|safetensors|fsspec|pandas|pyarrow|datasets|webdataset|zarr|universal.pathlib|numpy)==' \
  | sed 's/^/    /' >&2
say "  torch $TORCH_AFTER unchanged"
done_step

step 5 "sfstore demo --data-dir (a temporary directory), from outside the checkout, twice (the second finds the first's data)"
user sfstore demo --data-dir "$W/demo-data"
user sfstore demo --data-dir "$W/demo-data"
done_step

step 6 "import every face from the installed wheel"
user python - <<'EOF'
import importlib
import os
import sys

import sfstore
from sfstore import errors

where = os.path.dirname(sfstore.__file__)
assert where.startswith(sys.prefix), f"sfstore imported from {where}, not from the venv {sys.prefix}"
faces = ["sfstore.fs", "sfstore.checkpoint", "sfstore.checkpoint.dcp", "sfstore.checkpoint.hf",
         "sfstore.checkpoint.hf_trainer", "sfstore.checkpoint.hf_trainer_callback", "sfstore.checkpoint.lightning",
         "sfstore.kvcache", "sfstore.blocks", "sfstore.integrations.upath", "sfstore.integrations.webdataset_gopen",
         "sfstore.cli", "sfstore.probe"]
for name in faces:
    importlib.import_module(name)
    print(f"  import {name}: ok")
from sfstore.checkpoint.hf_trainer import SfstoreTrainerCallback  # noqa: E402,F401
print("  from sfstore.checkpoint.hf_trainer import SfstoreTrainerCallback: ok")
# the engines' faces: (face, the engine it plugs into, the extra that brings it)
engine_faces = [("sfstore.kvcache.vllm", "vllm", "vllm"), ("sfstore.kvcache.vllm_offload", "vllm", "vllm"),
                ("sfstore.kvcache.lmcache", "lmcache", "lmcache"), ("sfstore.kvcache.sglang", "sglang", "sglang")]
for name, engine, extra in engine_faces:
    try:
        importlib.import_module(engine)
    except ImportError:
        pass
    else:
        importlib.import_module(name)
        print(f"  import {name}: ok ({engine} is installed)")
        continue
    try:
        importlib.import_module(name)
    except errors.MissingDependencyError as exc:
        assert f"pip install 'sfstore[{extra}]'" in str(exc), str(exc)
        print(f"  import {name}: MissingDependencyError as expected without {engine}: {exc}")
    else:
        raise AssertionError(f"{name} imported without {engine}")
print(f"sfstore {sfstore.__version__} from {where}")
EOF
done_step

step 7 "sfstore probe (exit 0 on the embedded default)"
if user sfstore probe >"$W/probe.txt" 2>&1; then rc=0; else rc=$?; fi
# head reads the file itself: a pipe into head would SIGPIPE its writer under pipefail once the table outgrows 20 lines
head -n 20 "$W/probe.txt" | sed 's/^/    /' >&2
[ $rc -eq 0 ] || fail "sfstore probe exited $rc"
done_step

step 8 "sfstore config check (exit 0 on the embedded default)"
user sfstore config check || fail "sfstore config check exited $?"
done_step

step 9 "README's quick starts, twice in a row (tools/docblocks.py run README.md --repeat 2)"
# docblocks.py is stdlib-only; it runs with the fresh venv's python, so the blocks import the installed wheel
user "$FRESH/bin/python" "$ROOT/tools/docblocks.py" run "$ROOT/README.md" --repeat 2 || fail "README's quick starts failed"
done_step

say "wheel-check passed in $((SECONDS - T0)) s: sfstore[$EXTRAS] from a wheel, beside torch $TORCH_BEFORE"
printf '    %s\n' "${TIMES[@]}" >&2
