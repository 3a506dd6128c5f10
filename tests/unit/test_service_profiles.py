"""``dflctl install-service --profile``: every shipped device profile's ``[resources]``
reach the unit through a drop-in, so the Raspberry Pi, Jetson and generic units differ;
the Jetson units get the GPU's device access; ``--dry-run`` shows the difference."""

import argparse
import itertools
import json
import shutil
import subprocess

import pytest

from dfl_agent.cli.cli_ops import build_plan
from dfl_agent.cli.dflctl import main as dflctl
from dfl_agent.profiles.schema import ProfileError, list_profiles, profile_from_dict


def unit_directives(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit's [Service] section (read here, independently of the CLI)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def _args(root, profile, instance=None) -> argparse.Namespace:
    return argparse.Namespace(root=str(root), instance=instance, exec_path="/usr/bin/true", profile=profile,
                              config=None, force=False, no_start=True, dry_run=True, verbose=False, json=False)


def _effective(plan, template="dfl-agent.service") -> dict[str, list[str]]:
    """The [Service] directives systemd would apply: the unit, then the drop-in (a drop-in
    value replaces the unit's; DeviceAllow lines add up, as in systemd)."""
    files = {p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1]: c for p, (c, _) in plan.files.items()}
    eff = unit_directives(files[f"system/{template}"])
    for key, values in unit_directives(files.get(f"{template}.d/50-resources.conf", "")).items():
        eff[key] = values if key != "DeviceAllow" else eff.get(key, []) + values
    return eff


def test_every_shipped_profile_gives_its_own_unit(tmp_path):
    units = {p.name: (p, _effective(build_plan(_args(tmp_path, p.name)))) for p in list_profiles()}
    assert {"raspberry-pi-4", "jetson-nano", "jetson-orin-nano", "generic-x86", "generic-cuda"} <= set(units)
    for (a, (_, ua)), (b, (_, ub)) in itertools.combinations(units.items(), 2):
        assert ua != ub, f"{a} and {b} install the same unit"
    from dfl_agent.profiles.schema import memory_max_mib

    for name, (prof, eff) in units.items():
        (mem,) = eff["MemoryMax"]
        assert memory_max_mib(mem) >= prof.compute.memory_budget_mb, name  # the run's own budget fits
        (quota,) = eff["CPUQuota"]
        assert int(quota.rstrip("%")) >= 100 * max(prof.compute.threads, 1), name
        gpu = prof.compute.device == "cuda"
        assert eff["PrivateDevices"] == (["no"] if gpu else ["yes"]), name  # CPU devices keep /dev private
        assert bool(eff.get("DeviceAllow")) == gpu, name
    for jetson in ("jetson-nano", "jetson-orin-nano"):
        eff = units[jetson][1]
        for node in ("/dev/nvmap rw", "/dev/nvhost-ctrl-gpu rw", "/dev/nvhost-as-gpu rw"):
            assert node in eff["DeviceAllow"], (jetson, node)
        assert eff["SupplementaryGroups"] == ["video"]
    assert units["generic-cuda"][1]["DeviceAllow"] == ["char-nvidia* rw"]
    pi = units["raspberry-pi-4"][1]
    assert pi["MemoryMax"] == ["1536M"] and pi["CPUQuota"] == ["300%"] and pi["Nice"] == ["5"]
    assert pi["IOWeight"] == ["50"]


def test_every_unit_delegates_its_cgroup_and_outlives_an_oom_killed_run(tmp_path):
    """Each run's process gets its own memory cgroup below the service's: the unit delegates
    its cgroup (and leaves the cgroup file system writable), and the kernel's OOM kill of a
    run does not stop the service. No profile's drop-in changes that."""
    for prof in [None, *(p.name for p in list_profiles())]:
        for instance, template in ((None, "dfl-agent.service"), ("lab", "dfl-agent@.service")):
            eff = _effective(build_plan(_args(tmp_path / f"{prof}-{template}", prof, instance)), template)
            assert eff["Delegate"] == ["yes"] and eff["OOMPolicy"] == ["continue"], (prof, template)
            assert eff.get("ProtectControlGroups", ["no"]) == ["no"], (prof, template)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_every_profiles_unit_and_drop_in_pass_systemd_analyze_verify(tmp_path):
    staged = tmp_path / "units"
    staged.mkdir()
    for prof in list_profiles():  # one folder, one verify call: dfl-agent-<profile>.service (+ .d/)
        plan = build_plan(_args(tmp_path / prof.name, prof.name))
        for path, (content, _) in plan.files.items():
            if "/systemd/system/" not in path:
                continue
            rel = path.split("/systemd/system/", 1)[1].replace("dfl-agent.service", f"dfl-agent-{prof.name}.service")
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            (staged / rel).write_text(content)
        assert (staged / f"dfl-agent-{prof.name}.service.d/50-resources.conf").exists(), prof.name
    r = subprocess.run(["systemd-analyze", "verify", *map(str, sorted(staged.glob("*.service")))],
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for bad in ("Unknown key", "ignoring", "Invalid", "Failed to parse"):
        assert bad not in out, out


def test_dry_run_shows_what_the_profile_changes_and_writes_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    assert dflctl(["install-service", "--dry-run", "--root", str(root), "--exec", "/usr/bin/true",
                   "--profile", "raspberry-pi-4"]) == 0
    out = capsys.readouterr().out
    assert "dfl-agent.service.d/50-resources.conf" in out
    for line in ("MemoryMax: 2G -> 1536M", "CPUQuota: 200% -> 300%", "Nice: (unset) -> 5", "IOWeight: (unset) -> 50"):
        assert line in out, out
    assert not root.exists()
    assert dflctl(["install-service", "--dry-run", "--json", "--root", str(root), "--exec", "/usr/bin/true",
                   "--profile", "jetson-nano", "--instance", "lab"]) == 0
    plan = json.loads(capsys.readouterr().out)
    changes = {c["directive"]: c for c in plan["resources"]}
    assert changes["PrivateDevices"] == {"directive": "PrivateDevices", "unit": "yes", "profile": "no"}
    assert "/dev/nvmap rw" in changes["DeviceAllow"]["profile"]
    assert any(p.endswith("dfl-agent@.service.d/50-resources.conf") for p in plan["files"])
    assert dflctl(["install-service", "--dry-run", "--exec", "/usr/bin/true", "--profile", "no-such"]) == 2
    assert "unknown device profile 'no-such'" in capsys.readouterr().err


@pytest.mark.parametrize("resources, key", [
    ({"memory_max": "lots"}, "resources.memory_max: must be a size"),
    ({"memory_max": "512M"}, "resources.memory_max: 512M is below compute.memory_budget_mb"),
    ({"device_allow": ["/dev/nvmap rw"]}, "resources.device_allow: needs resources.private_devices = false"),
    ({"private_devices": False, "device_allow": ["nvmap"]}, "resources.device_allow[0]: must be"),
    ({"nice": 40}, "resources.nice: must be in [-20, 19]"),
    ({"io_weight": 20000}, "resources.io_weight"),
    ({"limit": 1}, "resources.limit: unknown key"),
])
def test_bad_resources_are_refused_with_the_key(resources, key):
    with pytest.raises(ProfileError) as exc:
        profile_from_dict({"name": "x", "compute": {"memory_budget_mb": 1024}, "resources": resources})
    assert str(exc.value).startswith(key), str(exc.value)
