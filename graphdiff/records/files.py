"""Persisted records as versioned JSON: written whole or not at all, read back with one clear error naming the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from graphdiff.errors import GraphdiffError

SCHEMA_VERSION = 2
M = TypeVar("M", bound=BaseModel)


def save_json(obj: BaseModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(obj.model_dump_json(indent=1))
    tmp.replace(path)  # never leave a half-written file behind
    return path


KIND_NAMES = {"graphdiff.capture": "capture", "graphdiff.scan": "scan", "graphdiff.kl": "kl result",
              "graphdiff.manifest": "patch manifest", "graphdiff.engine_samples": "engine samples file",
              "graphdiff.check": "check result"}
REMAKE = {"capture": "graphdiff capture", "scan": "graphdiff scan", "kl result": "graphdiff kl",
          "patch manifest": "graphdiff patch SCAN_DIR --out DIR"}


def parse_versioned(cls: type[M], path: Path, what: str, version: int = SCHEMA_VERSION) -> M:
    """`path` read as a `cls`, or one GraphdiffError naming the file and the fix: unreadable, not JSON, another kind
    of graphdiff file, a newer or older schema, or the first field that does not validate."""
    from pydantic import ValidationError

    remake = REMAKE.get(what, "graphdiff")
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise GraphdiffError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise GraphdiffError(f"{path} is not valid JSON ({why}): regenerate it with `{remake}`") from None
    kind = cls.model_fields["kind"].default if "kind" in cls.model_fields else None
    found = data.get("kind") if isinstance(data, dict) else None
    if kind and found != kind:
        is_a = f"a graphdiff {KIND_NAMES[found]}" if found in KIND_NAMES else "not a graphdiff file"
        raise GraphdiffError(f"{path} is {is_a}, not a {what}: give the {what} (`{remake}` writes it)")
    got = data.get("schema_version", version)
    if isinstance(got, int) and got != version:
        how = "upgrade graphdiff" if got > version else f"regenerate it with `{remake}`"
        who = "a newer" if got > version else "an older"
        raise GraphdiffError(f"{path} is a {what} of schema {got}, written by {who} graphdiff (this one reads "
                             f"{version}): {how}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "(top level)"
        raise GraphdiffError(f"{path} is not a valid {what}: field {field}: {err['msg']} "
                             f"(regenerate it with `{remake}`)") from None


def load_versioned(cls: type[M], path: Path, what: str) -> M:
    """A persisted model, or one clear GraphdiffError (missing, not valid, other kind or schema version)."""
    if not path.is_file():
        raise GraphdiffError(f"no {what} at {path}" if not path.is_dir() else f"{path} is a directory, not a {what}")
    return parse_versioned(cls, path, what)
