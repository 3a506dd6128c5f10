"""The one TOML type checker (dfl_agent.tomlcheck), shared by the configuration and the profiles."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dfl_agent.profiles import ProfileError, profile_from_dict
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict
from dfl_agent.tomlcheck import build

REPO = Path(__file__).resolve().parents[2]


class Bad(ValueError):
    pass


@dataclasses.dataclass
class Inner:
    rate: float = 1.0
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outer:
    count: int = 0
    flag: bool = False
    label: str | None = None
    table: dict[str, Any] = dataclasses.field(default_factory=dict)
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_build_converts_and_defaults():
    o = build(Outer, {"count": 3, "inner": {"rate": 2, "names": ["a"]}, "table": {"x": 1}}, error=Bad)
    assert o == Outer(count=3, inner=Inner(rate=2.0, names=["a"]), table={"x": 1})
    assert isinstance(o.inner.rate, float)


@pytest.mark.parametrize(("raw", "message"), [
    ({"count": "3"}, "count: expected int, got '3'"),
    ({"count": True}, "count: expected int, got True"),
    ({"flag": 1}, "flag: expected bool, got 1"),
    ({"inner": 5}, "inner: must be a table"),
    ({"inner": {"names": "a"}}, "inner.names: must be a list, got 'a'"),
    ({"inner": {"names": ["a", 2]}}, "inner.names[1]: expected str, got 2"),
    ({"inner": {"bogus": 1}}, "inner.bogus: unknown key (known: rate, names)"),
    ({"table": [1]}, "table: must be a table, got [1]"),
])
def test_errors_are_one_line_naming_the_key(raw, message):
    with pytest.raises(Bad) as info:
        build(Outer, raw, error=Bad)
    assert str(info.value) == message


def test_sorted_known_keys():
    with pytest.raises(Bad, match=r"^zz: unknown key \(known: count, flag, inner, label, table\)$"):
        build(Outer, {"zz": 1}, error=Bad, sort_known=True)


def test_config_and_profiles_use_the_shared_checker():
    with pytest.raises(ConfigError, match=r"^mqtt\.chunk_size: expected int, got 'big'$"):
        config_from_dict({"mqtt": {"chunk_size": "big"}})
    with pytest.raises(ProfileError, match=r"^training\.epochs: expected int, got 'x'$"):
        profile_from_dict({"name": "p", "training": {"epochs": "x"}})
    # no second copy of the checker: neither module inspects type annotations itself
    for rel in ("agent/runtime/shared/config.py", "agent/profiles/schema.py"):
        text = (REPO / rel).read_text(encoding="utf-8")
        assert "get_type_hints" not in text and "get_origin" not in text, rel


# ---- read_toml: a file bounded in size and nesting, its errors naming the file and the key

def _read(tmp_path: Path, data: bytes, **kw: Any) -> Any:
    from dfl_agent.tomlcheck import read_toml

    p = tmp_path / "f.toml"
    p.write_bytes(data)
    return read_toml(p, **kw)


@pytest.mark.parametrize("data, key, reason", [
    (b"[a]\nx = " + b"[" * 3000 + b"]" * 3000 + b"\n", "a.x", "nested deeper than 32 levels (line 2)"),
    (b"[[run]]\n[[run]]\nopts = { k = " + b"{ k = " * 40 + b"1" + b" }" * 41 + b"\n", "run[1].opts", "nested deeper"),
    (b"a" + b".b" * 40 + b" = 1\n", "a" + ".b" * 31, "nested deeper than 32 levels"),  # dotted keys: after parsing
    (b"[x]\nname = \"caf\xe9\"\n", "x.name", "not UTF-8 text: byte 0xe9 at line 2, column 12"),
    (b"# caf\xe9\n", "line 1", "not UTF-8 text: byte 0xe9 at line 1, column 6"),
    (b"x = 1 # \xff\n", "line 1", "not UTF-8 text: byte 0xff at line 1, column 9"),
])
def test_read_toml_refuses_deep_or_non_utf8_files_naming_the_key(tmp_path, data, key, reason):
    from dfl_agent.tomlcheck import TomlFileError

    with pytest.raises(TomlFileError) as e:
        _read(tmp_path, data)
    assert (e.value.key, e.value.path) == (key, str(tmp_path / "f.toml")) and reason in e.value.reason, str(e.value)
    assert str(e.value) == f"{tmp_path / 'f.toml'}: {key}: {e.value.reason}" and "\n" not in str(e.value)


def test_read_toml_reads_what_is_within_its_bounds(tmp_path):
    from dfl_agent.tomlcheck import TomlFileError

    # brackets inside strings and comments are no nesting; 29 levels of arrays under [[run]] are 32
    text = ('s = "[[[[{{{{"\nm = """\n]]]] [[[[ \\""" """\nl = \'\'\'[[[[\'\'\'  # [[[[\n[[run]]\nx = '
            + "[" * 29 + "]" * 29 + "\n")
    doc = _read(tmp_path, text.encode())
    assert doc["s"] == "[[[[{{{{" and doc["l"] == "[[[[" and "run" in doc
    with pytest.raises(TomlFileError, match=r"run\[0\]\.x: nested deeper than 32 levels$"):
        _read(tmp_path, text.replace("[" * 29, "[" * 30).replace("]" * 29, "]" * 30).encode())
    with pytest.raises(TomlFileError, match=r": larger than 100 bytes$"):
        _read(tmp_path, b"x = 1\n" * 20, max_bytes=100)


def test_check_config_names_the_key_of_a_deep_or_non_utf8_config(tmp_path, capsys):
    """dfl-agent check-config: one line, exit 2 (a RecursionError thousands of lines long on 75535c2)."""
    from dfl_agent.runtime.service.daemon import main

    path = tmp_path / "node.toml"
    for data, words in ((b'federation = "f"\n[algorithm]\noptions = { x = ' + b"[" * 2000 + b"]" * 2000 + b" }\n",
                         "algorithm.options: nested deeper than 32 levels"),
                        (b'federation = "f\xe9"\n', "federation: not UTF-8 text: byte 0xe9 at line 1, column 16")):
        path.write_bytes(data)
        assert main(["check-config", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: {words}" in err, err[-2000:]
