"""The wheel's package list matches the source tree, and shipped resources resolve."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    st = _setuptools()
    listed = set(st["packages"])
    mapping = st["package-dir"]
    found = set()
    for src, folder in (("dfl_agent", "agent"), ("dfl_agent.cli", "tools")):
        assert mapping[src] == folder
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([src, *rel.parts]) if rel.parts else src)
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"


def test_no_generic_top_level_import_names_are_installed() -> None:
    st = _setuptools()
    tops = {name.split(".")[0] for name in st["packages"]}
    assert tops == {"dfl_agent"}


def test_shipped_resources_resolve() -> None:
    from dfl_agent.profiles.schema import list_profiles
    from dfl_agent.resources import resource_dir

    assert (resource_dir("systemd") / "dfl-agent.service").is_file()
    assert (resource_dir("mosquitto") / "dfl.acl").is_file()
    assert "generic-x86" in {p.name for p in list_profiles()}


def test_a_profile_in_an_override_folder_replaces_the_shipped_file(tmp_path, monkeypatch) -> None:
    from dfl_agent.profiles.schema import get_profile, profile_files
    from dfl_agent.resources import resource_dir

    shipped = (resource_dir("device_profiles") / "generic-x86.toml").read_text(encoding="utf-8")
    assert "description" in shipped
    override = tmp_path / "generic-x86.toml"
    text = []
    for line in shipped.splitlines():
        text.append('description = "site override"' if line.startswith("description") else line)
    override.write_text("\n".join(text) + "\n", encoding="utf-8")
    monkeypatch.setenv("DFL_PROFILES_DIR", str(tmp_path))
    files = {f.name: f for f in profile_files()}
    assert files["generic-x86.toml"] == override
    assert "raspberry-pi-4.toml" in files  # the other shipped profiles stay visible
    assert get_profile("generic-x86").description == "site override"
