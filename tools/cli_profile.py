"""``dflctl profile``: device profiles.

  dflctl profile detect [--json] [--algorithm dfml]   which profile fits this machine, and why
  dflctl profile list [--json]                        every profile, one line each
  dflctl profile show NAME [--json]                   one profile's fields

``detect`` reads the machine (CPU, memory, torch.cuda, /proc/device-tree/model,
/etc/nv_tegra_release, battery and temperatures via psutil); ``--device-tree`` and
``--tegra-release`` read other files instead (to check a board's files elsewhere).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from dfl_agent.cli.output import json_doc

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def cmd_detect(a: argparse.Namespace) -> int:
    from dfl_agent.profiles import ResourceGate, collect_facts, detect, list_profiles, select_behaviour
    from dfl_agent.profiles.detect import DEVICE_TREE_MODEL, TEGRA_RELEASE

    facts = collect_facts(device_tree_model=a.device_tree or DEVICE_TREE_MODEL,
                          tegra_release=a.tegra_release or TEGRA_RELEASE)
    det = detect(facts, list_profiles(a.profiles_dir))
    prof = det.profile
    out: dict[str, Any] = det.to_dict()
    if not prof.inference_only:
        beh = select_behaviour(prof, a.algorithm if a.algorithm in prof.behaviour.algorithms
                               else prof.behaviour.algorithms[0])
        out["behaviour"] = beh.to_dict()
    gate = ResourceGate(prof.limits, prof.training.windows).check()
    out["gated"] = gate
    if a.json:
        print(json_doc(out))
        return 0
    f = facts
    print(f"machine: {f.arch}, {f.cpu_count} CPUs, {f.memory_mb} MiB, "
          f"CUDA: {', '.join(f'{d.name} ({d.memory_mb} MiB)' for d in f.cuda) or 'none'}, "
          f"torch: {'yes' if f.torch else 'no'}")
    print(f"device tree: {f.device_tree_model or '-'}; L4T: {f.tegra_release or '-'}; "
          f"battery: {f.battery or '-'}; temperatures: {f.temperatures or '-'}; "
          f"load/core: {f.load_per_core if f.load_per_core is None else round(f.load_per_core, 2)}")
    for line in det.explain():
        print(line)
    if "behaviour" in out:
        print(f"behaviour ({out['behaviour']['algorithm']}):")
        for r in out["behaviour"]["reasons"]:
            print(f"    {r}")
    print(f"training now: {'allowed' if gate is None else 'gated: ' + gate}")
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    from dfl_agent.profiles import list_profiles

    profiles = list_profiles(a.profiles_dir)
    if a.json:
        print(json_doc([p.to_dict() for p in profiles], key="profiles"))
        return 0
    for p in profiles:
        alias = f" (alias {', '.join(p.aliases)})" if p.aliases else ""
        print(f"{p.name:18s} {p.compute.device:5s} model {p.model.size:6s} roles {','.join(p.behaviour.roles):36s} "
              f"{p.description}{alias}")
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    from dfl_agent.profiles import get_profile
    from dfl_agent.profiles.behaviour import (
        REFERENCE_MODEL_PARAMS,
        algorithm_need_mb,
        allowed_algorithms,
        model_tier,
        models_held,
    )

    p = get_profile(a.name, a.profiles_dir)
    d = p.to_dict()
    rule = allowed_algorithms(p)
    d["algorithm_rule"] = {alg: {"listed": alg in p.behaviour.algorithms, "rule_allows": why is None,
                                 "reason": why or ""} for alg, why in rule.items()}
    if a.json:
        print(json_doc(d))
        return 0
    d.pop("algorithm_rule")
    for section, value in d.items():
        if isinstance(value, dict):
            print(f"[{section}]")
            for k, v in value.items():
                print(f"  {k} = {json.dumps(v)}")
        else:
            print(f"{section} = {json.dumps(value)}")
    print(f"algorithms (allowed when the default model fits {p.compute.memory_budget_mb} MiB counting every model "
          "held at once, and the profile gives the roles needed):")
    left = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in p.behaviour.left_out}
    for alg, why in rule.items():
        tier = model_tier(p, alg)
        need = algorithm_need_mb(alg, REFERENCE_MODEL_PARAMS[tier])
        if alg in p.behaviour.algorithms:
            print(f"  {alg:11s} listed    ~{need:.1f} MiB ({models_held(alg):g} copies of the {tier} model)"
                  + ("" if why is None else f"; the rule would leave it out: {why}"))
        else:
            print(f"  {alg:11s} left out  {left.get(alg) or why or 'not listed by the profile'}")
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl profile {detect,list,show}``."""
    p = sub.add_parser("profile", help="device profiles: detect, list, show")
    ps = p.add_subparsers(dest="profile_cmd", required=True)
    d = ps.add_parser("detect", help="which profile fits this machine, and why")
    d.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    d.add_argument("--algorithm", default="dfml", help="federation algorithm for the behaviour shown")
    d.add_argument("--device-tree", default=None, help="read this file instead of /proc/device-tree/model")
    d.add_argument("--tegra-release", default=None, help="read this file instead of /etc/nv_tegra_release")
    d.set_defaults(func=cmd_detect)
    li = ps.add_parser("list", help="every profile")
    li.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    li.set_defaults(func=cmd_list)
    s = ps.add_parser("show", help="one profile's fields and which algorithms it allows, and why")
    s.add_argument("name", help="profile name (dflctl profile list) or a profile TOML file")
    s.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    s.set_defaults(func=cmd_show)
    for c in (d, li, s):
        c.add_argument("--profiles-dir", default=None, help="profile folder (default: device_profiles/)")
