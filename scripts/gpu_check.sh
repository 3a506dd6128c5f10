#!/usr/bin/env bash
# Prove CUDA on a real GPU: one script, offline, under 8 minutes on a machine with one
# NVIDIA GPU, Python 3.12 and a CUDA build of torch.
#
#   scripts/gpu_check.sh OUTDIR [--wheels DIR] [--venv DIR] [--python PY] [--parts LIST]
#
# --wheels DIR  install the project and what the machine lacks from DIR (made by
#               scripts/gpu_wheels.sh) with `pip install --no-index`: DIR/requirements.txt,
#               then the project's wheel with --no-deps.  The venv (--venv, default a new
#               one under /tmp) is created with --system-site-packages, so it sees the
#               machine's torch.  Without --wheels: no install, PY must import dfl_agent.
# --venv DIR    the venv to install into and run from (created when missing).
# --python PY   the interpreter (default python3; .venv/bin/python for a checkout).
# --parts LIST  of tests,simulate,batch,federation (default all).
#
# What it runs (each step's output under OUTDIR):
#   1. the tests marked `cuda` (tests/unit/test_cuda.py): device selection, the training
#      step on CUDA against cpu (TF32 off, 1e-4 relative), AMP on and off, evaluation, the
#      batched step, checkpoints CUDA -> cpu -> CUDA, the ONNX export of a CUDA-trained
#      model, the simulator;                                    -> cuda-tests.txt, .xml
#   2. dflctl simulate, fedavg on digits, 1000 nodes x 3 rounds (speed) and 100 x 10
#      (accuracy within 0.01, > 0.5), --device cuda against --device cpu;
#   3. the batched training step on CUDA against the per-node loop on CUDA;
#   4. two agents over an amqtt broker on loopback, mdns off (MQTT presence only), one on
#      CUDA, one on cpu: models exchanged and aggregated every round.
#                                       (2-4: bench/gpu/check.py) -> results.json, summary.md
# Also env.txt (interpreter, torch, nvidia-smi, pip freeze), install.log, gpu_check.log.
#
# Without a CUDA device every CUDA part is skipped and the script says so; it still runs
# the cpu sides (and the cuda tests' logic with cpu in place of the GPU), so that the
# script itself is exercised.  Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
[[ $# -ge 1 && "$1" != -* ]] || { sed -n 2,16p "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
OUT=$1; shift
WHEELS=""; VENV=""; PY="${PYTHON:-python3}"; PARTS="tests,simulate,batch,federation"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --venv) VENV=${2:?--venv needs a folder}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --parts) PARTS=${2:?--parts needs a list}; shift 2 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu_check.log") 2>&1
T0=$SECONDS
say() { echo "gpu_check [$((SECONDS - T0))s]: $*"; }
FAILED=()

# -- install ---------------------------------------------------------------------------------
VPY=$PY
if [[ -n "$WHEELS" ]]; then
  WHEELS=$(cd "$WHEELS" && pwd)
  [[ -f "$WHEELS/requirements.txt" ]] || { say "FAILED: $WHEELS/requirements.txt missing (scripts/gpu_wheels.sh makes it)"; exit 1; }
  [[ -n "$VENV" ]] || VENV=$(mktemp -d /tmp/dfl-gpu-check.XXXXXX)/venv
  if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV (--system-site-packages: the machine's torch stays visible)"
    "$PY" -m venv --system-site-packages "$VENV" || { say "FAILED: $PY -m venv"; exit 1; }
  fi
  VPY=$VENV/bin/python
  say "installing from $WHEELS (offline: --no-index)"
  {
    "$VPY" -m pip install --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt" &&
    "$VPY" -m pip install --no-index --no-deps --force-reinstall "$WHEELS"/dfl_agent-*.whl
  } >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; say "FAILED: pip install (see install.log)"; exit 1; }
  "$VPY" -m pip check >>"$OUT/install.log" 2>&1 || say "pip check reports conflicts (see install.log)"
fi
"$VPY" -c 'import torch, dfl_agent' 2>/dev/null || { say "FAILED: $VPY cannot import torch and dfl_agent"; exit 1; }

# -- environment -----------------------------------------------------------------------------
{
  "$VPY" - <<'EOF'
import platform, sys, torch, dfl_agent
print(f"python {platform.python_version()} {platform.machine()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory // 2**20} MiB, capability {p.major}.{p.minor}")
print(f"dfl-agent {dfl_agent.__version__} ({dfl_agent.__file__})")
EOF
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  echo "--- pip freeze"; "$VPY" -m pip freeze 2>/dev/null
} >"$OUT/env.txt" 2>&1
head -4 "$OUT/env.txt"
CUDA=$("$VPY" -c 'import torch; print(int(torch.cuda.is_available()))')
if [[ "$CUDA" != 1 ]]; then
  say "NO CUDA DEVICE: torch sees none. Every CUDA part is SKIPPED; the cpu sides run (a dry run of this script)."
fi

# -- 1. the cuda tests -----------------------------------------------------------------------
if [[ ",$PARTS," == *",tests,"* ]]; then
  say "1. the tests marked cuda"
  timeout 300 "$VPY" -m pytest -q -m cuda tests/unit/test_cuda.py -rs -p no:cacheprovider \
    --junitxml="$OUT/cuda-tests.xml" >"$OUT/cuda-tests.txt" 2>&1
  rc=$?
  tail -15 "$OUT/cuda-tests.txt"
  [[ $rc -eq 0 ]] || FAILED+=("cuda tests (rc $rc)")
  if [[ "$CUDA" != 1 ]]; then
    say "1b. no CUDA: the same tests' logic with cpu in place of the GPU (DFL_CUDA_TESTS_ON_CPU=1; proves nothing about CUDA)"
    DFL_CUDA_TESTS_ON_CPU=1 timeout 300 "$VPY" -m pytest -q -m cuda tests/unit/test_cuda.py -rs -p no:cacheprovider \
      >"$OUT/cuda-tests-on-cpu.txt" 2>&1
    rc=$?
    tail -5 "$OUT/cuda-tests-on-cpu.txt"
    [[ $rc -eq 0 ]] || FAILED+=("cuda tests on cpu (rc $rc)")
  fi
fi

# -- 2-4. simulator, batched step, federation ---------------------------------------------------
CHECK_PARTS=$(echo ",$PARTS," | tr ',' '\n' | grep -E '^(simulate|batch|federation)$' | paste -sd, -)
if [[ -n "$CHECK_PARTS" ]]; then
  say "2-4. $CHECK_PARTS (bench/gpu/check.py)"
  SMI_PID=""
  if [[ "$CUDA" == 1 ]] && command -v nvidia-smi >/dev/null 2>&1; then  # device memory as the driver sees it
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 >"$OUT/nvidia-smi.csv" 2>&1 &
    SMI_PID=$!
  fi
  timeout 420 "$VPY" bench/gpu/check.py "$OUT" --parts "$CHECK_PARTS"
  rc=$?
  [[ -n "$SMI_PID" ]] && kill "$SMI_PID" 2>/dev/null
  [[ $rc -eq 0 ]] || FAILED+=("bench/gpu/check.py (rc $rc)")
fi

say "done in $((SECONDS - T0)) s; outputs in $OUT"
[[ "$CUDA" == 1 ]] || say "NO CUDA DEVICE: the CUDA parts were skipped; this run proves the script, not CUDA"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  say "FAILED: ${FAILED[*]}"
  exit 1
fi
say "every step that ran passed"
