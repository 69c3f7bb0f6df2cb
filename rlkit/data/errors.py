"""DataError, on its own so the data modules (prompts, the built-in sets) import it without
importing each other."""

from __future__ import annotations

from rlkit.common.errors import UserError


class DataError(UserError, ValueError):
    """Unusable prompt data; the message names the file and the row."""
