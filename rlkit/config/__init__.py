"""Typed recipes: the schema, the loader (extends + overrides) and the generated reference."""

from rlkit.config.loader import RecipeError, dump_recipe, load_recipe
from rlkit.config.schema import Recipe

__all__ = ["Recipe", "RecipeError", "dump_recipe", "load_recipe"]
