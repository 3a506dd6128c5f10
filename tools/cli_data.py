"""``dflctl data add|status``: the on-device sample store (torch-free)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dfl_agent.cli.dflctl import DflctlParser


def state_dir_args(p: argparse.ArgumentParser) -> None:
    """``--state-dir`` and ``--config`` (the state directory of the agent)."""
    p.add_argument("--state-dir", default=None,
                   help="the agent's state directory (default: from --config, else $DFL_STATE_DIR or /var/lib/dfl-agent)")
    p.add_argument("--config", default=None, help="node configuration (TOML): state_dir and [data] from it")


def resolve(a: argparse.Namespace) -> tuple[Path, Any]:
    """(state_dir, config or None) from ``--state-dir`` / ``--config``."""
    cfg = None
    if a.config:
        from dfl_agent.runtime.shared.config import load_config

        cfg = load_config(a.config)
    sd = a.state_dir or (cfg.state_dir if cfg else None) or os.environ.get("DFL_STATE_DIR") or "/var/lib/dfl-agent"
    return Path(sd), cfg


def cmd_add(a: argparse.Namespace) -> int:
    from dfl_agent.store.sqlite import copy_into_spool

    sd, cfg = resolve(a)
    spool = Path(cfg.data.spool_dir) if cfg and cfg.data.spool_dir else sd / "spool"
    for f in a.files:
        dest = copy_into_spool(f, spool)
        print(f"{f} -> {dest} (the agent ingests it on its next spool pass)")
    return 0


def _time(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_status(a: argparse.Namespace) -> int:
    from dfl_agent.store.sqlite import SampleStore

    sd, cfg = resolve(a)
    if not (sd / "store" / "samples.sqlite").exists():
        raise FileNotFoundError(f"no sample store under {sd} (state_dir/store/samples.sqlite)")
    store = SampleStore(sd, None, create=False)
    try:
        st = store.status()
    finally:
        store.close()
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    names = list(st["class_names"])
    unnamed = names == [str(i) for i in range(len(names))]  # the store's default names "0", "1", ...
    cfg_names = list(cfg.data.class_names or ()) if cfg is not None else []
    if unnamed and cfg_names:
        names, unnamed = cfg_names, False
    print(f"{st['samples']} samples of shape {st['input_shape']} in {st['store']}")
    for label, n in st["per_class"].items():
        name = names[int(label)] if int(label) < len(names) else str(label)
        print(f"  class {label}: {n}" if unnamed or name == str(label) else f"  class {label} ({name}): {n}")
    if unnamed and st["per_class"]:
        print("  (no class names: set data.class_names in the node configuration, or pass --config)")
    print(f"oldest {_time(st['oldest'])}, newest {_time(st['newest'])}")
    print(f"ingested {st['ingested_files']} files ({st['ingested_samples']} samples), evicted {st['evicted_samples']} "
          f"samples, {st['spool_waiting']} files waiting in the spool")
    kinds = ", ".join(f"{k}: {n}" for k, n in sorted(st.get("rejected_by_kind", {}).items()))
    print(f"rejected {st['rejected']} files" + (f" ({kinds})" if kinds else ""))
    for r in st["rejected_files"]:
        print(f"  {r['name']}: {r['reason']}")
    return 0


def register(sub: argparse._SubParsersAction[DflctlParser]) -> None:
    """Add ``dflctl data`` to the dflctl sub-parsers."""
    d = sub.add_parser("data", help="the on-device sample store: add files, show its status")
    ds = d.add_subparsers(dest="data_cmd", required=True)
    ad = ds.add_parser("add", help="copy .npz files (x, y, optional t, groups) into the agent's spool")
    ad.add_argument("files", nargs="+", help=".npz files")
    state_dir_args(ad)
    ad.set_defaults(func=cmd_add)
    st = ds.add_parser("status", help="samples per class, oldest/newest, ingested and rejected files")
    state_dir_args(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)
