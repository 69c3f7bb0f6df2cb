"""Load a recipe: YAML files that may extend a base, plus `key.path=value` overrides.

Errors name the key path and where its value came from (a file or the command line), e.g.

    recipes/my.yaml: rollout.over_provison: unknown key (did you mean 'over_provision'?)
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from rlkit.buffers.errors import UserError
from rlkit.config.schema import Recipe

CMDLINE = "command line"
Origins = dict[tuple[str, ...], str]


class RecipeError(UserError, ValueError):
    """A recipe that cannot be loaded; the message lists every problem with its key path."""


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    raw, origins = resolve_raw(path, overrides)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, origins, path)) from None


def resolve_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[dict, Origins]:
    """The merged, not yet validated recipe and, for each key path, where it was last set."""
    raw: dict[str, Any] = {}
    origins: Origins = {}
    if path is not None:
        raw = _load_file(Path(path), origins, chain=())
    for item in overrides:
        _apply_override(raw, origins, item)
    return raw, origins


# -- files and extends ------------------------------------------------------------------------
def _load_file(path: Path, origins: Origins, chain: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    shown = _display(path)
    if path in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, path))
        raise RecipeError(f"{shown}: 'extends' cycle: {cycle}")
    if not path.is_file():
        raise RecipeError(f"{shown}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{shown}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{shown}: a recipe must be a mapping of sections, got {type(data).__name__}")

    bases = data.pop("extends", None)
    merged: dict[str, Any] = {}
    if bases is not None:
        if isinstance(bases, str):
            bases = [bases]
        if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
            raise RecipeError(f"{shown}: extends: expected a file name or a list of file names")
        for base in bases:
            base_path = (path.parent / base).resolve()
            _deep_merge(merged, _load_file(base_path, origins, (*chain, path)), origins, None, ())
    _deep_merge(merged, data, origins, shown, ())
    return merged


def _deep_merge(
    dst: dict, src: dict, origins: Origins, origin: str | None, prefix: tuple[str, ...]
) -> None:
    """Merge src into dst; mappings merge key by key, anything else replaces."""
    for key, value in src.items():
        key = str(key)
        at = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value, origins, origin, at)
        else:
            dst[key] = value
            if origin is not None:
                _forget_below(origins, at)
                _mark(origins, at, value, origin)


def _mark(origins: Origins, at: tuple[str, ...], value: Any, origin: str) -> None:
    origins[at] = origin
    if isinstance(value, dict):
        for k, v in value.items():
            _mark(origins, (*at, str(k)), v, origin)


def _forget_below(origins: Origins, at: tuple[str, ...]) -> None:
    for key in [k for k in origins if k[: len(at)] == at and len(k) > len(at)]:
        del origins[key]


# -- overrides ------------------------------------------------------------------------------
def _apply_override(raw: dict, origins: Origins, item: str) -> None:
    if "=" not in item:
        raise RecipeError(f"{CMDLINE}: override {item!r} is not of the form key.path=value")
    key, _, text = item.partition("=")
    parts = tuple(p.strip() for p in key.strip().split("."))
    if not all(parts):
        raise RecipeError(f"{CMDLINE}: override {item!r}: empty key in {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"{CMDLINE}: override {key}: value {text!r} is not valid YAML: {e}") from None
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            hint = ""
            if isinstance(child, str):  # a setting given by a bare name, e.g. a correction
                hint = (f"; a setting given by a bare name ({child!r}) takes fields once "
                        f"written as a section, e.g. {where}.estimator={child}")
            raise RecipeError(f"{CMDLINE}: override {key}: {where} is a value, not a section{hint}")
        node = child
    node[parts[-1]] = value
    _forget_below(origins, parts)
    _mark(origins, parts, value, CMDLINE)


# -- error messages -------------------------------------------------------------------------
def _format_errors(err: ValidationError, origins: Origins, path: str | Path | None) -> str:
    default_origin = _display(Path(path).resolve()) if path is not None else "recipe defaults"
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        where = _origin_of(loc, origins) or default_origin
        dotted = ".".join(loc)
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _suggest(loc)
        else:
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            # The bad value, not a whole section: a check across a section's keys (a model
            # validator) gets the section as its input, and its message names the keys itself.
            if ("input" in e and e["type"] not in ("missing",) and loc
                    and not isinstance(e["input"], (dict, list))):
                msg += f" (got {e['input']!r})"
        lines.append(f"{where}: {dotted}: {msg}" if dotted else f"{where}: {msg}")
    return "invalid recipe:\n  " + "\n  ".join(lines)


def _origin_of(loc: tuple[str, ...], origins: Origins) -> str | None:
    """Who set this key. A section (a check across its keys) names every source of the keys
    in it, since a base file and what extends it may each have set some; a value names
    whoever set it or its nearest parent."""
    below = [o for key, o in origins.items() if key[: len(loc)] == loc and len(key) > len(loc)]
    if below:
        return ", ".join(dict.fromkeys(below))
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    return None


def _suggest(loc: tuple[str, ...]) -> str:
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None:
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(model.model_fields)}"


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=100)


def iter_fields(model: type[BaseModel], prefix: str = "") -> Iterable[tuple[str, Any, Any]]:
    """(dotted path, FieldInfo, owning model) for every leaf field, depth first."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from iter_fields(ann, path + ".")
        else:
            yield path, field, model
