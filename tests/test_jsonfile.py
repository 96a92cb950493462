"""Specification of weft.jsonfile: reading a user's JSON with clear errors, writing atomically."""
from __future__ import annotations

import json

import pytest

from weft import jsonfile
from weft.jsonfile import read_json, write_json


def test_write_json_makes_the_folder_and_round_trips(tmp_path):
    path = write_json(tmp_path / "a" / "b" / "doc.json", {"x": [1, 2.5, None]})
    assert path == tmp_path / "a" / "b" / "doc.json"
    assert json.loads(path.read_text()) == {"x": [1, 2.5, None]}
    assert read_json(path, "missing") == {"x": [1, 2.5, None]}
    assert [p.name for p in path.parent.iterdir()] == ["doc.json"]  # no temporary file left


def test_an_interrupted_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = write_json(tmp_path / "doc.json", {"version": 1})

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(jsonfile.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"version": 2})
    assert json.loads(path.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["doc.json"]  # the temporary file is cleaned up


def test_read_json_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such report"):
        read_json(tmp_path / "nowhere.json", "no such report")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON .*; run it again"):
        read_json(bad, "missing", remedy="run it again")
