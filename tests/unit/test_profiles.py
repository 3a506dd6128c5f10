"""Device profiles: validation, detection from fixture files, decision table, gating,
device selection with a faked torch.cuda (the hardware edge), config integration."""

from __future__ import annotations

import asyncio
import datetime
import types

import numpy as np
import pytest

from dfl_agent.profiles import (
    ProfileError,
    ResourceGate,
    collect_facts,
    detect,
    get_profile,
    list_profiles,
    peer_incompatibility,
    resolve_device,
    select_behaviour,
    with_overrides,
)
from dfl_agent.profiles.detect import Facts
from dfl_agent.profiles.gating import in_windows
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict

# -- fakes at the hardware edge -----------------------------------------------------------


class FakePsutil:
    """Stand-in for the psutil module: only the calls detection and gating make."""

    def __init__(self, *, battery=None, temps=None, load=0.1, cpus=4, memory_mb=4096):
        self.battery, self.temps, self.load, self.cpus, self.memory_mb = battery, temps or {}, load, cpus, memory_mb

    def sensors_battery(self):
        if self.battery is None:
            return None
        pct, plugged = self.battery
        return types.SimpleNamespace(percent=pct, power_plugged=plugged, secsleft=0)

    def sensors_temperatures(self):
        return {k: [types.SimpleNamespace(label="", current=v, high=None, critical=None)] for k, v in self.temps.items()}

    def getloadavg(self):
        return (self.load * self.cpus, 0.0, 0.0)

    def cpu_count(self, logical=True):
        return self.cpus

    def virtual_memory(self):
        return types.SimpleNamespace(total=self.memory_mb * 1024 * 1024)


class FakeCuda:
    """Stand-in for torch.cuda."""

    def __init__(self, devices=()):
        self.devices = list(devices)

    def is_available(self):
        return bool(self.devices)

    def device_count(self):
        return len(self.devices)

    def get_device_properties(self, i):
        name, mb = self.devices[i]
        return types.SimpleNamespace(name=name, total_memory=mb * 1024 * 1024)


def facts_for(tmp_path, model=None, tegra=None, arch="aarch64", cuda=(), memory_mb=4096):
    dt = tegra_file = None
    if model is not None:
        dt = tmp_path / "model"
        dt.write_bytes(model.encode() + b"\x00")  # the kernel NUL-terminates it
    if tegra is not None:
        tegra_file = tmp_path / "nv_tegra_release"
        tegra_file.write_text(tegra)
    return collect_facts(device_tree_model=dt, tegra_release=tegra_file, psutil_mod=FakePsutil(memory_mb=memory_mb),
                         cuda=FakeCuda(cuda), machine=lambda: arch)


# -- profiles -----------------------------------------------------------------------------


def test_all_profiles_load_and_cover_the_device_classes():
    names = {p.name for p in list_profiles()}
    assert {"raspberry-pi-4", "raspberry-pi-5", "jetson-nano", "jetson-orin-nano", "generic-x86", "generic-cuda",
            "sensor-gateway", "inference-only"} <= names
    assert get_profile("x86-cpu").name == "generic-x86"  # alias
    gw = get_profile("sensor-gateway")
    assert "aggregator" not in gw.behaviour.roles and gw.behaviour.compression != "none" and gw.model.size == "small"
    assert get_profile("inference-only").inference_only


@pytest.mark.parametrize("section, value, key", [
    ({"limits": {"min_battery_percent": 150}}, None, "profile_overrides.limits.min_battery_percent"),
    ({"compute": {"device": "tpu"}}, None, "profile_overrides.compute.device"),
    ({"behaviour": {"roles": ["boss"]}}, None, "profile_overrides.behaviour.roles[0]"),
    ({"training": {"windows": ["25:00-26:00"]}}, None, "profile_overrides.training.windows[0]"),
    ({"compute": {"threads": "four"}}, None, "profile_overrides.compute.threads"),
    ({"limits": {"nope": 1}}, None, "profile_overrides.limits.nope"),
    ({"match": {"arch": ["x"]}}, None, "profile_overrides.match"),
])
def test_bad_overrides_name_the_key(section, value, key):
    with pytest.raises(ProfileError) as e:
        with_overrides(get_profile("raspberry-pi-4"), section)
    assert str(e.value).startswith(key)


def test_override_single_field():
    p = with_overrides(get_profile("raspberry-pi-4"), {"limits": {"min_battery_percent": 55}})
    assert p.limits.min_battery_percent == 55 and p.limits.max_temperature_c == 75


def test_bad_profile_file_names_file_and_key(tmp_path):
    (tmp_path / "bad.toml").write_text('name = "bad"\n[compute]\nmemory_budget_mb = 1\n')
    with pytest.raises(ProfileError, match=r"bad.toml: compute.memory_budget_mb"):
        list_profiles(tmp_path)


# -- detection ------------------------------------------------------------------------------


def test_this_machine_is_generic_x86():
    det = detect()  # the real machine (x86, no GPU): the acceptance check
    assert det.profile.name == "generic-x86"
    assert any("CPU architecture x86_64" in r for c in det.candidates for r in c.reasons)


@pytest.mark.parametrize("model, tegra, arch, want", [
    ("Raspberry Pi 4 Model B Rev 1.4", None, "aarch64", "raspberry-pi-4"),
    ("Raspberry Pi 4 Model B Rev 1.2", None, "armv7l", "raspberry-pi-4"),
    ("Raspberry Pi 5 Model B Rev 1.0", None, "aarch64", "raspberry-pi-5"),
    ("NVIDIA Jetson Nano Developer Kit", "# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref", "aarch64",
     "jetson-nano"),
    ("NVIDIA Jetson Orin Nano Developer Kit", "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic",
     "aarch64", "jetson-orin-nano"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit", "# R35 (release), REVISION: 4.1", "aarch64",
     "jetson-orin-nano"),
])
def test_fixture_files_detect_boards(tmp_path, model, tegra, arch, want):
    facts = facts_for(tmp_path, model, tegra, arch)
    det = detect(facts)
    assert det.profile.name == want, det.explain()
    assert det.facts.device_tree_model == model  # NUL stripped


def test_cuda_machine_and_explanations(tmp_path):
    facts = facts_for(tmp_path, arch="x86_64", cuda=[("NVIDIA H100", 81559)])
    det = detect(facts)
    assert det.profile.name == "generic-cuda"
    gx = next(c for c in det.candidates if c.profile.name == "generic-x86")
    assert not gx.matched and "no: 1 CUDA device(s) (want none)" in gx.reasons
    assert det.to_dict()["facts"]["cuda"] == [{"name": "NVIDIA H100", "memory_mb": 81559}]


def test_no_torch_detects_inference_only():
    facts = Facts(arch="armv7l", cpu_count=1, memory_mb=512, torch=False)
    assert detect(facts).profile.name == "inference-only"


def test_sensor_gateway_only_by_pinning():
    facts = Facts(arch="aarch64", cpu_count=1, memory_mb=256)
    with pytest.raises(LookupError):
        detect(facts, [get_profile("sensor-gateway")])


# -- decision table -----------------------------------------------------------------------


def test_dfml_mixes_sizes_by_profile_and_averaging_uses_the_common_model():
    cpu = FakeCuda()
    sizes = {n: select_behaviour(get_profile(n), "dfml", cuda=cpu).model_size
             for n in ("raspberry-pi-4", "generic-x86", "jetson-orin-nano")}
    assert sizes == {"raspberry-pi-4": "small", "generic-x86": "medium", "jetson-orin-nano": "large"}
    for n in ("raspberry-pi-4", "jetson-orin-nano"):
        assert select_behaviour(get_profile(n), "dechw", cuda=cpu).model_size == "medium"
    assert select_behaviour(get_profile("raspberry-pi-4"), "dfml", config_model_size="large", cuda=cpu).model_size == "large"


def test_roles_compression_and_errors():
    gw = select_behaviour(get_profile("sensor-gateway"), "dfml", cuda=FakeCuda())
    assert "aggregator" not in gw.roles and gw.compression == "topk:0.01+q8"
    with pytest.raises(ProfileError, match="behaviour.algorithms"):
        select_behaviour(get_profile("sensor-gateway"), "dechw")
    tiny = with_overrides(get_profile("raspberry-pi-4"), {"compute": {"memory_budget_mb": 64}})
    b = select_behaviour(tiny, "dfml", model_params=1_000_000, participants=5, cuda=FakeCuda())
    assert "aggregator" not in b.roles and any("aggregator dropped" in r for r in b.reasons)
    assert select_behaviour(get_profile("inference-only"), "dfml").algorithm == "inference"


def test_cuda_device_selection_with_faked_cuda():
    assert resolve_device("cuda", FakeCuda([("Orin", 7600)]))[0] == "cuda:0"
    assert resolve_device("cuda:1", FakeCuda([("A", 1), ("B", 1)]))[0] == "cuda:1"
    dev, why = resolve_device("cuda", FakeCuda())
    assert dev == "cpu" and "falling back to cpu" in why
    assert resolve_device("auto", FakeCuda([("A", 1)]))[0] == "cuda:0"
    assert resolve_device("auto", FakeCuda())[0] == "cpu"
    orin = select_behaviour(get_profile("jetson-orin-nano"), "dfml", cuda=FakeCuda([("Orin", 7600)]))
    assert orin.device == "cuda:0" and orin.mixed_precision
    orin_cpu = select_behaviour(get_profile("jetson-orin-nano"), "dfml", cuda=FakeCuda())
    assert orin_cpu.device == "cpu" and not orin_cpu.mixed_precision


def test_mixed_precision_is_cuda_only_and_cpu_training_unchanged():
    import torch

    from dfl_agent.learning.training import TrainConfig, autocast_for, train_local
    from dfl_agent.models import build_model

    assert autocast_for("cuda:0", True) == (True, "cuda", torch.float16)
    assert autocast_for("cpu", True)[0] is False
    spec = {"type": "mlp", "input_shape": [4], "hidden": [8], "num_classes": 3}
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = np.arange(40) % 3
    outs = []
    for mp in (False, True):
        torch.manual_seed(0)
        m = build_model(spec)
        train_local(m, x, y, TrainConfig(mixed_precision=mp), np.random.default_rng(1))
        outs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.equal(outs[0], outs[1])


def test_peer_incompatibility():
    check = peer_incompatibility("dechw", "aaa")
    peer = types.SimpleNamespace(algorithm="dechw", model_hash="bbb")
    assert "differs" in check(peer)
    assert check(types.SimpleNamespace(algorithm="dechw", model_hash="aaa")) is None
    assert check(types.SimpleNamespace(algorithm="", model_hash="")) is None
    assert "runs dfml" in check(types.SimpleNamespace(algorithm="dfml", model_hash="aaa"))
    assert check(types.SimpleNamespace(algorithm="inference", model_hash="")).startswith("inference-only")
    assert peer_incompatibility("dfml", "aaa")(peer := types.SimpleNamespace(algorithm="dfml", model_hash="b")) is None


# -- gating -----------------------------------------------------------------------------------


def gate(psutil_mod, windows=(), hour=12, **limits):
    lim = with_overrides(get_profile("raspberry-pi-4"), {"limits": limits} if limits else None).limits
    return ResourceGate(lim, windows, psutil_mod=psutil_mod, now=lambda: datetime.datetime(2026, 1, 1, hour, 30))


def test_gating_reasons():
    assert gate(FakePsutil(battery=(80, False))).check() is None
    assert "battery 12% < 30%" in gate(FakePsutil(battery=(12, False))).check()
    assert gate(FakePsutil(battery=(12, True))).check() is None  # external power
    assert gate(FakePsutil(battery=None)).check() is None  # no battery
    assert "temperature 81.0°C (cpu_thermal) >= 75.0°C" in gate(FakePsutil(temps={"cpu_thermal": 81.0})).check()
    assert "load 2.00 per core >= 1.50" in gate(FakePsutil(load=2.0)).check()
    assert gate(FakePsutil(load=2.0), max_load_per_core=0).check() is None
    assert "outside training windows" in gate(FakePsutil(), ["22:00-06:00"], hour=12).check()
    assert gate(FakePsutil(), ["22:00-06:00"], hour=23).check() is None


def test_windows():
    t = datetime.datetime(2026, 1, 1, 5, 59)
    assert in_windows(["22:00-06:00"], t) and not in_windows(["06:00-22:00"], t) and in_windows([], t)
    assert in_windows(["00:00-24:00"], datetime.datetime(2026, 1, 1, 23, 59))


def test_battery_drop_stops_training_within_one_round_and_status_says_why():
    """Simulated federation (memory transport, virtual clock): node01's battery drops
    after its round 2; its next training waits, its status says 'gated: battery ...',
    node00 goes on alone; recharging resumes training."""
    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.data import load_dataset, make_node_data, partition
    from dfl_agent.discovery.peers import PeerTable
    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.models import default_spec
    from dfl_agent.runtime.node.context import RuntimeContext
    from dfl_agent.runtime.node.node import Node
    from dfl_agent.transport.memory import MemoryNetwork, run_virtual

    bundle = load_dataset("digits")
    parts = partition(bundle.pool, 2, "iid", seed=0)
    spec = default_spec(bundle.pool.input_shape, bundle.pool.num_classes, "small")
    net = MemoryNetwork()
    battery = FakePsutil(battery=(90, False))
    nodes = []
    for i in range(2):
        nid = f"node{i:02d}"
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f", {"algorithm": "fedavg"}),
                             peers=PeerTable(nid, "f"), data=make_node_data(bundle, parts[i], seed=0), model_spec=spec,
                             train=TrainConfig(batch_size=64), init_seed=0, rng=np.random.default_rng(i))
        cls = get_algorithm("fedavg")
        nodes.append(Node(ctx, cls(ctx, parse_options(cls, {"round_timeout": 5.0})), bundle.test.x[:100],
                          bundle.test.y[:100], rounds=5))
    g = gate(battery)
    nodes[1].ctx.gate, nodes[1].ctx.gate_poll = g.check, 1.0
    seen: dict = {}

    async def main():
        for n in nodes:
            await n.ctx.start()
            await n.setup()

        async def drain_battery(t, record):
            if t == 2:
                battery.battery = (10, False)
        nodes[1].hooks.after_round.append(drain_battery)

        async def watch():
            while nodes[1].ctx.gated is None:
                await asyncio.sleep(0.5)
            await asyncio.sleep(30)  # virtual seconds: node00 meanwhile trains alone
            seen["status"] = nodes[1].status()
            seen["published"] = dict(nodes[1].ctx.transport.last_status)
            seen["rounds_gated"] = len(nodes[1].history)
            seen["node00_rounds"] = len(nodes[0].history)
            seen["node00_live"] = nodes[0].ctx.live_peers()
            battery.battery = (10, True)  # plugged in: resumes

        await asyncio.gather(nodes[0].run(5), nodes[1].run(5), watch())

    run_virtual(main())
    assert seen["rounds_gated"] == 2  # round 3's training never started while gated
    assert seen["status"]["gated"].startswith("battery 10% < 30%") and seen["status"]["state"] == "gated"
    assert seen["published"]["gated"] == seen["status"]["gated"]  # published at once
    assert seen["node00_rounds"] > 2  # the other node went on meanwhile
    assert len(nodes[1].history) == 5 and nodes[1].ctx.gated is None  # resumed after recharging


# -- configuration ------------------------------------------------------------------------------


def test_config_pins_profiles_and_names_bad_keys():
    cfg = config_from_dict({"profile": "raspberry-pi-4", "profile_overrides": {"limits": {"min_battery_percent": 40}}})
    assert cfg.profile == "raspberry-pi-4" and cfg.training.batch_size is None and cfg.model.size is None
    config_from_dict({"profile": "auto"})
    with pytest.raises(ConfigError, match=r"^profile: unknown device profile 'rpi9'"):
        config_from_dict({"profile": "rpi9"})
    with pytest.raises(ConfigError, match=r"^profile_overrides.limits.max_temperature_c"):
        config_from_dict({"profile": "raspberry-pi-4", "profile_overrides": {"limits": {"max_temperature_c": -3}}})
    with pytest.raises(ConfigError, match=r"^training.device"):
        config_from_dict({"training": {"device": "gpu"}})


def test_daemon_applies_profile():
    from dfl_agent.runtime.shared.assembly import apply_profile

    cfg = config_from_dict({"profile": "raspberry-pi-4", "algorithm": {"name": "dfml"}})
    prof, beh = apply_profile(cfg, "dfml")
    assert (beh.model_size, beh.threads, beh.batch_size, beh.compression) == ("small", 3, 32, "q8")
    cfg = config_from_dict({"profile": "raspberry-pi-4", "training": {"threads": 1, "batch_size": 8}})
    assert apply_profile(cfg, "fedavg")[1].threads == 1 and apply_profile(cfg, "fedavg")[1].batch_size == 8
    with pytest.raises(ValueError, match="inference-only"):
        apply_profile(config_from_dict({"profile": "inference-only"}), "dfml")


def test_cli_profile_detect_json(capsys):
    import json

    from dfl_agent.cli.dflctl import main

    assert main(["profile", "detect", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "generic-x86" and out["behaviour"]["device"] == "cpu"
    assert main(["profile", "show", "jetson-orin-nano", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compute"]["device"] == "cuda"
    assert main(["profile", "list"]) == 0


def test_sensor_gateway_sends_but_never_aggregates(tmp_path):
    """DFML with two sensor gateways and one x86 node: every round is led by the x86
    node (round 1 would otherwise go to the lowest id, node00, a gateway)."""
    import json

    from dfl_agent.learning.training import TrainConfig
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    s = simulate(SimConfig(algorithm="dfml", nodes=3, rounds=2, dataset="digits", partition="iid",
                           profiles=["sensor-gateway", "x86-cpu"], options={"mutual_epochs": 1},
                           train=TrainConfig(batch_size=64), eval_every=10, out=str(tmp_path)))
    assert s["profiles"] == {"node00": "sensor-gateway", "node01": "generic-x86", "node02": "sensor-gateway"}
    assert s["rounds_completed"] == 2
    sizes = {n: spec["hidden"] for n, spec in s["model_specs"].items()}
    assert sizes["node00"] != sizes["node01"]  # small (gateway) vs medium (x86)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["aggregator"] for r in records} == {"node01"}


# -- the profile rule: which algorithms each shipped profile allows ---------------------------
def test_every_shipped_profile_lists_exactly_what_the_rule_allows():
    from dfl_agent.algorithms.base import available
    from dfl_agent.profiles.behaviour import allowed_algorithms

    KNOWN_ALGORITHMS = available()
    for prof in list_profiles():
        rule = allowed_algorithms(prof)
        allowed = {a for a, why in rule.items() if why is None}
        assert set(prof.behaviour.algorithms) == allowed, prof.name
        assert set(prof.behaviour.algorithms) <= set(KNOWN_ALGORITHMS), prof.name
        if prof.inference_only:
            continue
        reasons = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in prof.behaviour.left_out}
        assert set(reasons) == set(KNOWN_ALGORITHMS) - allowed, f"{prof.name}: one left_out line per algorithm left out"
        assert all(reasons.values()), prof.name
    # every training profile runs the local baseline; the big ones run all eighteen
    assert set(get_profile("generic-x86").behaviour.algorithms) == set(KNOWN_ALGORITHMS)
    assert set(get_profile("raspberry-pi-4").behaviour.algorithms) == set(KNOWN_ALGORITHMS)


def test_profile_rule_counts_every_model_held_and_the_roles():
    from dfl_agent.profiles.behaviour import algorithm_fit, algorithm_need_mb, models_held

    pi = get_profile("raspberry-pi-4")
    assert algorithm_fit(pi, "dfml") is None
    # an aggregator holds its participants' models: a model that fits alone does not fit 5×6 times
    phi = int((pi.compute.memory_budget_mb - 64) * 1024 * 1024 / 4 / 10)
    assert algorithm_fit(pi, "local", model_params=phi) is None
    why = algorithm_fit(pi, "dfml", model_params=phi)
    assert why is not None and "MiB" in why and "budget 1024" in why
    assert models_held("dechw") > models_held("fedavg") > models_held("local")
    assert algorithm_need_mb("dfml", 1_000_000, participants=10) > algorithm_need_mb("dfml", 1_000_000, participants=5)
    gw = get_profile("sensor-gateway")
    assert "receiver" in (algorithm_fit(gw, "fedavg") or "")
    assert algorithm_fit(gw, "heterofl") is None


def test_reference_params_match_the_code():
    pytest.importorskip("torch")
    from dfl_agent.data.har import CHANNELS, CLASS_NAMES, WINDOW
    from dfl_agent.models import build_model, count_trainable, default_spec
    from dfl_agent.profiles.behaviour import REFERENCE_MODEL_PARAMS

    for tier, phi in REFERENCE_MODEL_PARAMS.items():
        spec = default_spec((len(CHANNELS), WINDOW), len(CLASS_NAMES), tier)
        assert count_trainable(build_model(spec)) == phi, tier


def test_profile_show_explains_the_algorithms(capsys):
    from dfl_agent.cli.dflctl import main

    assert main(["profile", "show", "sensor-gateway"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "left out" in out and "receiver" in out
    assert "heterofl" in out and "listed" in out
