"""attnkit._machine: where measured choices are kept, the machine key they are kept under, and files that are
written whole or not at all and read as empty when they are not this machine's, well-formed file."""

import json
from pathlib import Path

import pytest

from attnkit import _machine


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("ATTNKIT_CACHE_DIR", raising=False)
    assert _machine.cache_dir() == tmp_path / "home" / ".cache" / "attnkit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _machine.cache_dir() == tmp_path / "xdg" / "attnkit"
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "mine"))
    assert _machine.cache_dir() == tmp_path / "mine"
    assert _machine.path("k") == tmp_path / "mine" / f"k-{_machine.machine_id()}.json"
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", "")
    assert _machine.cache_dir() is None and _machine.path("k") is None
    assert _machine.load("k") == {} and _machine.save("k", {"a": {}}) is None and _machine.remove("k") is None
    assert not (tmp_path / "home").exists() and not (tmp_path / "xdg").exists()


def test_the_machine_key_names_the_cpu_and_torch_build():
    key = _machine.machine()
    assert key["cores"] >= 1 and isinstance(key["cpu"], str) and key["cpu"]
    assert set(key["isa"]) <= set(_machine._ISA) and key["isa"] == sorted(key["isa"])
    assert key["torch"] and key["capability"]
    other = {**key, "isa": [*key["isa"], "amx_tile"] if "amx_tile" not in key["isa"] else []}
    assert _machine.machine_id(other) != _machine.machine_id() == _machine.machine_id(dict(key))


def test_choices_round_trip_and_other_machines_files_read_as_empty(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "new"))
    choices = {"1x8x8@2": {"kernel": "linear", "seconds": {"linear": 1e-6}}}
    assert _machine.save("k", choices) is None  # (the folder is made)
    assert _machine.load("k") == choices and _machine.load("other") == {}
    where = _machine.path("k")
    assert where is not None
    data = json.loads(where.read_text())
    data["machine"] = {**data["machine"], "cores": data["machine"]["cores"] + 1}
    where.write_text(json.dumps(data))
    assert _machine.load("k") == {}  # another machine's choices
    data["machine"] = _machine.machine()
    data["format"] = _machine.FORMAT + 1
    where.write_text(json.dumps(data))
    assert _machine.load("k") == {}  # another format
    monkeypatch.setattr(_machine, "machine", lambda: {**data["machine"], "cpu": "another CPU"})
    assert _machine.path("k") != where and _machine.load("k") == {}  # another machine reads its own file


@pytest.mark.parametrize("text", ["", "{", "null", '{"format": 1}', "\x00\x01"])
def test_a_corrupt_file_reads_as_empty(monkeypatch, tmp_path, text):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    _machine.path("k").write_text(text)
    assert _machine.load("k") == {}


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    assert _machine.save("k", {"old": {}}) is None

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_machine.os, "replace", fail)
    problem = _machine.save("k", {"new": {}})
    assert problem == f"could not write {_machine.path('k')}: No space left on device"
    assert [p.name for p in tmp_path.iterdir()] == [_machine.path("k").name]
    assert _machine.load("k") == {"old": {}}


def test_an_unwritable_folder_is_reported_not_raised(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "a-file" / "attnkit"))
    problem = _machine.save("k", {"a": {}})
    assert problem is not None and problem.startswith(f"could not write {tmp_path / 'a-file' / 'attnkit'}")
    assert _machine.load("k") == {} and _machine.remove("k") is None


def test_remove_deletes_only_this_machines_file(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    _machine.save("k", {"a": {}})
    (tmp_path / "k-someone-else.json").write_text("{}")
    assert _machine.remove("k") == _machine.path("k") and _machine.remove("k") is None
    assert [p.name for p in Path(tmp_path).iterdir()] == ["k-someone-else.json"]


def test_merge_adds_to_what_the_file_holds_now(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    assert _machine.save(_machine.DECODE, {"1x8x8@2": {"kernel": "linear"}}) is None  # (another writer's record)
    records, problem = _machine.merge(_machine.DECODE, {"threads m; batch 1@2": {"threads": 1}})
    assert problem is None and set(records) == {"1x8x8@2", "threads m; batch 1@2"}
    assert _machine.load(_machine.DECODE) == records
    records, _ = _machine.merge(_machine.DECODE, {"threads m; batch 1@2": {"threads": 2}})
    assert records["threads m; batch 1@2"] == {"threads": 2} and records["1x8x8@2"] == {"kernel": "linear"}
