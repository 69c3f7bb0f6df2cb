"""Render the recipe reference (every field: key path, type, default, constraints, description)."""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlkit.config.schema import Recipe


def render_reference() -> str:
    out = [
        "# Recipe reference",
        "",
        "Generated from the schema by `rlkit config docs`; do not edit by hand (a test fails when",
        "this file is stale). A recipe is a YAML mapping of these keys; any key may be omitted.",
        "A recipe may `extends: base.yaml` (or a list of files, merged in order, relative to the",
        "recipe); `key.path=value` arguments on the command line override both. Unknown keys,",
        "wrong types and out-of-range values are errors that name the key path and the file.",
        "`rlkit config show RECIPE [key.path=value ...]` prints the resolved recipe, each key",
        "marked `written: FILE`, `alias of OLD: FILE` (a moved key, below), `default` or",
        "`derived` (computed from other keys); `--no-defaults` leaves out the defaults.",
        "",
    ]
    for name, field in Recipe.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _section(out, name, ann, field.description or "")
        else:
            out += [f"## `{name}`", "", _row_text(name, field), ""]
    _moved(out)
    return "\n".join(out).rstrip() + "\n"


def _moved(out: list[str]) -> None:
    from rlkit.rollout.config import MOVED_KEYS

    out += [
        "## Moved keys",
        "",
        "Keys of the earlier layout (grouped by feature, not by policy), still read until the",
        "next release: each is read at its new place with a warning naming both paths; a file",
        "(or the command line) that sets both to different values is an error naming both.",
        "`rlkit config show` marks a value written under an old key `alias of <old key>`.",
        "",
        "| old key | new key |",
        "|---|---|",
    ]
    for old, new in MOVED_KEYS.items():
        each = ".*" if _is_section(new) else ""  # a section moves key by key
        out.append(f"| `rollout.{old}{each}` | `rollout.{new}{each}` |")
    out.append("")


def _is_section(path: str) -> bool:
    from rlkit.rollout.config import RolloutConfig

    model: Any = RolloutConfig
    for part in path.split("."):
        model = model.model_fields[part].annotation
    return isinstance(model, type) and issubclass(model, BaseModel)


def _section(out: list[str], path: str, model: type[BaseModel], description: str) -> None:
    out += [f"## `{path}`", ""]
    if description:
        out += [description, ""]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((f"{path}.{name}", ann, field.description or ""))
            continue
        out.append(
            f"| `{path}.{name}` | {_type(ann)} | {_default(field)} | "
            f"{_escape(field.description or '')}{_constraints(field)} |"
        )
    out.append("")
    for sub_path, sub_model, sub_desc in nested:
        _section(out, sub_path, sub_model, sub_desc)


def _row_text(name: str, field: Any) -> str:
    return (
        f"`{name}`: {_type(field.annotation)}, default {_default(field)}. "
        f"{field.description or ''}{_constraints(field)}"
    )


def _type(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in ann)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "null"
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(ann))
        return f"{origin.__name__}[{args}]"
    return getattr(ann, "__name__", str(ann))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value)}`"


def _constraints(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "min length")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sym} {getattr(meta, attr)}")
    return f" ({', '.join(parts)})" if parts else ""


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
