"""Reading a JSON file a user pointed at, with errors that name the file and how to remake it."""
from __future__ import annotations

import json
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
