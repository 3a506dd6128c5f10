#!/usr/bin/env bash
# Download what scripts/gpu_check.sh installs on an offline GPU machine.
#
#   scripts/gpu_wheels.sh DIR [--python-version 3.12] [--platform TAG]...
#
# Builds the project's wheel into DIR, then `pip download`s, as binary wheels for that
# Python on x86-64 Linux (manylinux), every dependency of the wheel and of its `test`,
# `broker`, `digits` and `onnx` extras: paho-mqtt, zeroconf and ifaddr, cryptography and pynacl with
# cffi and pycparser, blake3, zstandard, lz4, tomli-w, platformdirs, scikit-learn,
# pytest-asyncio, amqtt and its dependencies, onnx, onnxruntime, onnxscript, ...
# torch is not among them: the GPU machine brings its own CUDA build.  A dependency
# published only as a source archive is built here into a wheel (`pip wheel --no-deps`;
# pure-Python ones only, any compiled one is an error).
#
# DIR/requirements.txt pins every downloaded distribution but the project;
# scripts/gpu_check.sh installs them with `pip install --no-index --find-links DIR -r`,
# then the project's wheel with `--no-deps`.
#
# Options:
#   --python-version V   target interpreter (default 3.12; the GPU machine's)
#   --platform TAG       a platform tag to accept (repeatable; default manylinux2014_x86_64,
#                        manylinux_2_17_x86_64 ... manylinux_2_28_x86_64, linux_x86_64)
# Environment: PYTHON, the interpreter that builds and downloads (default .venv/bin/python,
# else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
[[ $# -ge 1 && "$1" != -* ]] || { echo "usage: scripts/gpu_wheels.sh DIR [--python-version 3.12] [--platform TAG]..." >&2; exit 2; }
DIR=$1; shift
PYV=3.12
PLATFORMS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) PYV=${2:?--python-version needs a value}; shift 2 ;;
    --platform) PLATFORMS+=("${2:?--platform needs a value}"); shift 2 ;;
    *) echo "gpu_wheels: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ ${#PLATFORMS[@]} -gt 0 ]] || PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64
                                          manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 linux_x86_64)
PY="${PYTHON:-}"
[[ -n "$PY" ]] || { [[ -x .venv/bin/python ]] && PY=$REPO/.venv/bin/python || PY=python3; }
EXTRAS="test,broker,digits,onnx"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
LOG="$DIR/gpu_wheels.log"
: >"$LOG"
say() { echo "gpu_wheels: $*"; }

say "building the project's wheel"
rm -f "$DIR"/dfl_agent-*.whl
"$PY" -m build --wheel --outdir "$DIR" . >>"$LOG" 2>&1 || { tail -20 "$LOG"; say "FAILED: python -m build"; exit 1; }
WHEEL=$(ls "$DIR"/dfl_agent-*.whl)
say "$(basename "$WHEEL")"

PLAT_ARGS=()
for p in "${PLATFORMS[@]}"; do PLAT_ARGS+=(--platform "$p"); done
# pip download with --python-version resolves binary wheels only: a dependency published
# only as a source archive fails the resolution, is built here (pure Python) and the
# download retried with DIR as a find-links source
for attempt in 1 2 3 4 5 6; do
  say "pip download for Python $PYV (${PLATFORMS[*]}), attempt $attempt"
  if "$PY" -m pip download -d "$DIR" --find-links "$DIR" --only-binary=:all: --python-version "$PYV" \
       --implementation cp "${PLAT_ARGS[@]}" "$WHEEL[$EXTRAS]" >>"$LOG" 2>&1; then
    ok=1; break
  fi
  ok=0
  # "No matching distribution found for NAME<spec>": build that one from its source archive
  need=$(grep -oE "No matching distribution found for [^ ]+" "$LOG" | tail -1 | awk '{print $NF}')
  [[ -n "$need" ]] || break
  say "no wheel for $need: building one from its source archive"
  "$PY" -m pip wheel --no-deps --no-binary=:all: -w "$DIR" "$need" >>"$LOG" 2>&1 || break
  built=$(ls -t "$DIR"/*.whl | head -1)
  case "$(basename "$built")" in
    *-py3-none-any.whl|*-py2.py3-none-any.whl) say "built $(basename "$built")" ;;
    *) say "FAILED: $need is not pure Python ($(basename "$built"))"; exit 1 ;;
  esac
done
[[ "$ok" == 1 ]] || { tail -20 "$LOG"; say "FAILED: pip download (see $LOG)"; exit 1; }

# the pinned list: NAME==VERSION of every wheel but the project's
"$PY" - "$DIR" "$(basename "$WHEEL")" <<'EOF'
import pathlib, re, sys
d, own = pathlib.Path(sys.argv[1]), sys.argv[2]
pins = {}
for w in sorted(d.glob("*.whl")):
    if w.name == own:
        continue
    name, version = w.name.split("-")[:2]
    pins[re.sub(r"[-_.]+", "-", name).lower()] = version
if "torch" in pins:
    sys.exit("gpu_wheels: torch was downloaded; the GPU machine brings its own")
(d / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
print(f"gpu_wheels: {len(pins)} dependencies pinned in {d / 'requirements.txt'}")
EOF
say "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
