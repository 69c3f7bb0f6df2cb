"""Suite-wide settings."""

from hypothesis import settings

# CI machines are shared and small: a per-example deadline measures their load, not the code.
settings.register_profile("rlkit", deadline=None)
settings.load_profile("rlkit")
