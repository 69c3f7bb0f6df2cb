"""Where each value of a resolved recipe came from, for `rlkit config show`.

Every leaf key gets one mark:

- `written: FILE` (or `command line`): the recipe set it, and it is used as written;
- `alias of OLD: FILE`: the recipe set it under a moved key (rollout.config.MOVED_KEYS);
- `default`: nobody set it; the schema's default;
- `derived`: nobody set it (or it was set to something else, e.g. 'auto'), and the schema
  computed the value from other keys (train.weight_sync.method 'auto', a correction's bounds).

A key of a policy section the selected policy does not read (rollout.partial under
tail_batching) that is not at its default is also marked `ignored`.

The output is the resolved recipe as YAML (it loads back to the same recipe) with the marks as
end-of-line comments.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter

from rlkit.config.loader import Path_, Sources
from rlkit.config.schema import Recipe
from rlkit.rollout.config import POLICY_SECTIONS

WRITTEN, ALIAS, DEFAULT, DERIVED = "written", "alias of", "default", "derived"
HEADER = ("# each key's source: 'written: FILE' (a recipe file or the command line set it),\n"
          "# 'alias of OLD: FILE' (set under a key that moved), 'default' (the schema's default),\n"
          "# 'derived' (computed from other keys, e.g. an 'auto' resolved)")


def provenance(recipe: Recipe, src: Sources) -> dict[Path_, str]:
    """key path -> its mark, for every leaf key of the recipe."""
    out: dict[Path_, str] = {}
    _walk(recipe, (), src, out)
    unread = set(POLICY_SECTIONS) - recipe.rollout.sections_read()
    for path, mark in out.items():
        if path[0] == "rollout" and path[1] in unread and not mark.startswith(DEFAULT):
            out[path] = f"{mark}; ignored: rollout.policy={recipe.rollout.policy} does not read it"
    return out


def annotated_dump(recipe: Recipe, src: Sources, defaults: bool = True) -> str:
    """The resolved recipe as YAML, each leaf key marked (provenance); `defaults=False` leaves
    out the keys at their default (and sections left empty)."""
    marks = provenance(recipe, src)
    rows: list[tuple[str, str]] = []
    _emit(recipe.model_dump(mode="json"), (), marks, defaults, rows)
    width = min(max((len(code) for code, mark in rows if mark), default=0), 72)
    lines = [HEADER]
    for code, mark in rows:
        lines.append(f"{code.ljust(width)}  # {mark}" if mark else code)
    return "\n".join(lines) + "\n"


def _walk(model: BaseModel, prefix: Path_, src: Sources, out: dict[Path_, str]) -> None:
    for name, field in type(model).model_fields.items():
        path = (*prefix, name)
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _walk(value, path, src, out)
        else:
            out[path] = _mark(path, field, value, src)


def _mark(path: Path_, field: Any, value: Any, src: Sources) -> str:
    origin = _written_by(path, src)
    if origin is not None:
        mark = (f"{ALIAS} {'.'.join(src.aliases[path][0])}: {origin}" if path in src.aliases
                else f"{WRITTEN}: {origin}")
        raw = _raw_at(src.raw, path)
        if not _same(field, raw, value):
            return f"{DERIVED} (written {_flow(raw)}, {mark})"
        return mark
    for n in range(len(path) - 1, 0, -1):  # a section given by a bare name, e.g. a correction
        above = path[:n]
        if above in src.origins and not isinstance(_raw_at(src.raw, above), dict):
            return (f"{DERIVED} from {'.'.join(above)}: {_flow(_raw_at(src.raw, above))} "
                    f"({src.origins[above]})")
    default = field.get_default(call_default_factory=True)
    if _equal(default, value):
        return DEFAULT
    return f"{DERIVED} (default {_flow(_plain(default))})" if default is not None else DERIVED


def _written_by(path: Path_, src: Sources) -> str | None:
    """Who wrote this key (or, for a mapping-valued key, keys inside it)."""
    if path in src.origins:
        return src.origins[path]
    below = [o for k, o in src.origins.items() if k[: len(path)] == path]
    return ", ".join(dict.fromkeys(below)) if below else None


def _raw_at(raw: Any, path: Path_) -> Any:
    for part in path:
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _same(field: Any, raw: Any, value: Any) -> bool:
    """Whether the written value, read as the key's type, is the value used."""
    try:
        return _equal(TypeAdapter(field.annotation).validate_python(raw), value)
    except Exception:  # not readable alone (validated with its section): compare as written
        return _equal(raw, value)


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # an enum member: its value


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _emit(node: dict, prefix: Path_, marks: dict[Path_, str], defaults: bool,
          rows: list[tuple[str, str]]) -> bool:
    """Append this section's rows; whether any row was kept."""
    indent = "  " * len(prefix)
    kept = False
    for key, value in node.items():
        path = (*prefix, key)
        if path not in marks and isinstance(value, dict):  # a section
            sub: list[tuple[str, str]] = []
            if _emit(value, path, marks, defaults, sub) or defaults:
                rows.append((f"{indent}{key}:", ""))
                rows.extend(sub)
                kept = True
            continue
        mark = marks.get(path, "")
        if not defaults and mark == DEFAULT:
            continue
        rows.append((f"{indent}{key}: {_flow(value)}", mark))
        kept = True
    return kept


def _flow(value: Any) -> str:
    """One line of YAML for a value (flow style for mappings and lists)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False)
    text = text.strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text
