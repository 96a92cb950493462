"""Reading a JSON file a user pointed at, with errors that name the file and how to remake it;
writing one atomically (a reader never sees half of it)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: str | Path, missing: str, remedy: str = "") -> Any:
    """The parsed content of `path`. FileNotFoundError(`missing`) if it is not a file;
    ValueError naming the file (and `remedy`, if given) if it is not valid JSON."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(missing)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}){'; ' + remedy if remedy else ''}") from None


def write_json(path: str | Path, doc: Any) -> Path:
    """Write `doc` as indented JSON to `path` (its folder made if missing) through a temporary
    file and a rename, so an interrupted write leaves the previous file whole; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
