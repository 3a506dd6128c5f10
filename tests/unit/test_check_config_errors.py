"""Configuration errors: one line naming the key, exit 2, no state directory left."""

import subprocess
import sys

import pytest

CASES = [
    ("[discovery]\nstatic_peers = [5]\n", "discovery.static_peers[0]"),
    ("[discovery]\nstatic_peers = [{port = 1}]\n", "discovery.static_peers[0]"),
]


@pytest.mark.parametrize("extra,key,command", [(*c, "check-config") for c in CASES] + [(*CASES[0], "run")])
def test_config_error_is_one_line_exit_2_and_leaves_no_state(tmp_path, extra, key, command):
    state = tmp_path / "state"
    path = tmp_path / "node.toml"
    path.write_text(f'federation = "f"\nstate_dir = "{state}"\n{extra}')
    args = [command, "--config", str(path)] + (["--once"] if command == "run" else [])
    p = subprocess.run([sys.executable, "-m", "dfl_agent.runtime.daemon", *args],
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in lines[0], lines
    assert not state.exists()
