"""Load a recipe: YAML files that may extend a base, plus `key.path=value` overrides.

Errors name the key path and where its value came from (a file or the command line), e.g.

    recipes/my.yaml: rollout.batch_sise: unknown key (did you mean 'batch_size'?)

Keys that moved (rlkit.rollout.config.MOVED_KEYS) are read at their new place for one release:
each source (a file, the command line) is moved on its own, before the merge, so a file that
extends one written the old way overrides it with either name; one source setting both names
to different values is an error naming both. Each old key written gives one
DeprecatedKeyWarning naming its file, the old path and the new. After validation, a policy's
section written while another policy is selected is reported (IgnoredKeyWarning) and ignored.
"""

from __future__ import annotations

import difflib
import sys
import warnings
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from rlkit.common.errors import UserError
from rlkit.config.schema import Recipe
from rlkit.rollout.config import (
    MOVED_KEYS, MOVED_ROOTS, POLICY_SECTIONS, DeprecatedKeyWarning, MovedKeyError,
    deprecation_message, move_keys, moved_to,
)

CMDLINE = "command line"
_PACKAGE = str(Path(__file__).resolve().parent)
Origins = dict[tuple[str, ...], str]
Path_ = tuple[str, ...]


class RecipeError(UserError, ValueError):
    """A recipe that cannot be loaded; the message lists every problem with its key path."""


class IgnoredKeyWarning(UserWarning):
    """A recipe key the selected configuration does not read (another policy's section)."""


@dataclass
class Sources:
    """A merged, not yet validated recipe and where each of its keys came from."""

    raw: dict[str, Any] = dc_field(default_factory=dict)
    origins: Origins = dc_field(default_factory=dict)  # key path -> the file (or command line) that set it last
    # new key path -> (old key path, origin) for a value the recipe wrote under a moved key
    aliases: dict[Path_, tuple[Path_, str]] = dc_field(default_factory=dict)
    top: str | None = None  # the recipe file named (not a base it extends), as origins show it


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    return load_with_sources(path, overrides)[0]


def load_with_sources(path: str | Path | None = None,
                      overrides: Sequence[str] = ()) -> tuple[Recipe, Sources]:
    """The validated recipe, and what was written where (`rlkit config show` marks it)."""
    src = resolve(path, overrides)
    try:
        recipe = Recipe.model_validate(src.raw)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, src, path)) from None
    _warn_ignored_sections(recipe, src)
    return recipe, src


def resolve_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[dict, Origins]:
    """The merged, not yet validated recipe and, for each key path, where it was last set."""
    src = resolve(path, overrides)
    return src.raw, src.origins


def resolve(path: str | Path | None, overrides: Sequence[str] = ()) -> Sources:
    """The merged, not yet validated recipe (moved keys at their new places) and its sources."""
    src = Sources()
    if path is not None:
        src.top = _display(Path(path).resolve())
        src.raw = _load_file(Path(path), src, chain=())
    # on the command line: leaf -> (key as written, value, whether that key is an old one)
    written: dict[Path_, tuple[str, Any, bool]] = {}
    for item in overrides:
        _apply_override(src, item, written)
    # an alias holds while its value is still the one the old key set
    src.aliases = {new: (old, o) for new, (old, o) in src.aliases.items()
                   if src.origins.get(new) == o}
    return src


# -- moved keys -----------------------------------------------------------------------------
def _move(data: dict[str, Any], origin: str, src: Sources) -> list[tuple[Path_, Path_]]:
    """Move one source's old `rollout.` keys to their new places (a warning each)."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or not any(k in rollout for k in MOVED_ROOTS):
        return []
    try:
        moved = move_keys(rollout)
    except MovedKeyError as e:
        raise RecipeError(f"{origin}: {e}") from None
    out = []
    for old, new in moved:
        _warn(f"{origin}: {deprecation_message(old, new)}", DeprecatedKeyWarning)
        out.append((("rollout", *old.split(".")), ("rollout", *new.split("."))))
    return out


def _warn(message: str, category: type[Warning]) -> None:
    """A warning attributed to the first caller outside this package (who loaded the recipe)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


def _warn_ignored_sections(recipe: Recipe, src: Sources) -> None:
    """A policy's section the selected policy does not read is ignored (a recipe may hold
    several policies' knobs and select one on the command line), and said so when the recipe
    file itself or the command line wrote it; one inherited from an extended base is the
    base's business (grpo_tiny_tail_ci.yaml extends a partial recipe) and goes unsaid."""
    rollout = recipe.rollout
    read = rollout.sections_read()
    policy = f"rollout.policy={rollout.policy}"
    if rollout.policy == "ranked_dispatch":
        policy += f" (base {rollout.ranked_dispatch.base})"
    for section in POLICY_SECTIONS:
        if section in read:
            continue
        written = [o for key, o in src.origins.items()
                   if key[:2] == ("rollout", section) and o in (src.top, CMDLINE)]
        if written:
            what = ("it serves ranked_dispatch and partial.adaptive" if section == "engine_model"
                    else f"it configures policy {section}")
            _warn(f"{', '.join(dict.fromkeys(written))}: rollout.{section} is ignored: "
                  f"{policy} does not read it ({what})", IgnoredKeyWarning)


# -- files and extends ------------------------------------------------------------------------
def _load_file(path: Path, src: Sources, chain: tuple[Path, ...]) -> dict[str, Any]:
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
            _deep_merge(merged, _load_file(base_path, src, (*chain, path)), src.origins, None, ())
    moved = _move(data, shown, src)
    _deep_merge(merged, data, src.origins, shown, ())
    for old, new in moved:
        src.aliases[new] = (old, shown)
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
def _apply_override(src: Sources, item: str, written: dict[Path_, tuple[str, Any, bool]]) -> None:
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
    sets = [(parts, value, None)]
    if len(parts) > 1 and parts[0] == "rollout" and parts[1] in MOVED_ROOTS:  # an old key
        one: dict[str, Any] = {}
        node = one
        for part in parts[1:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        holder = {"rollout": one}
        sets = [(new, _get(holder, new), old) for old, new in _move(holder, CMDLINE, src)]
    for at, v, old in sets:
        said = ".".join(old or at)
        for leaf, leaf_value in _leaf_items(at, v):
            before = written.get(leaf)  # one old and one new name, different values: which?
            if before is not None and (before[2] != (old is not None)) and before[1] != leaf_value:
                (new, new_value, _), (dep, dep_value, _) = sorted(
                    [before, (said, leaf_value, old is not None)], key=lambda e: e[2])
                raise RecipeError(
                    f"{CMDLINE}: {dep} and {new} are both set, to different values "
                    f"({dep_value!r} and {new_value!r}); {dep} is the deprecated name of "
                    f"{'.'.join(leaf)}: keep only {new}")
            written[leaf] = (said, leaf_value, old is not None)
        _set(src, at, v, key)
        if old is not None:
            src.aliases[at] = (old, CMDLINE)


def _set(src: Sources, parts: Path_, value: Any, key: str) -> None:
    node = src.raw
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
    _forget_below(src.origins, parts)
    _mark(src.origins, parts, value, CMDLINE)


def _get(raw: dict, parts: Path_) -> Any:
    node: Any = raw
    for part in parts:
        node = node[part]
    return node


def _leaf_items(at: Path_, value: Any) -> list[tuple[Path_, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaf_items((*at, str(k)), v)]
    return [(at, value)]


# -- error messages -------------------------------------------------------------------------
def _format_errors(err: ValidationError, src: Sources, path: str | Path | None) -> str:
    default_origin = _display(Path(path).resolve()) if path is not None else "recipe defaults"
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        where = _origin_of(loc, src.origins) or default_origin
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
        if loc in src.aliases:
            msg += f" (written as {'.'.join(src.aliases[loc][0])})"
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
    old = list(MOVED_ROOTS) if loc[:-1] == ("rollout",) else []
    close = difflib.get_close_matches(loc[-1], [*model.model_fields, *old], n=1)
    if close and close[0] in old:  # a misspelt old key: point at the new one
        new = moved_to(close[0]) or " and ".join(
            dict.fromkeys(v.split(".")[0] for k, v in MOVED_KEYS.items() if k.startswith(close[0] + ".")))
        return f" (did you mean {close[0]!r}? it is now rollout.{new})"
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
