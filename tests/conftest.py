"""Suite-wide settings."""

import os

from hypothesis import settings

# CI machines are shared and small: a per-example deadline measures their load, not the code.
# The suite's examples are derandomized (the same on every run), so CI can only fail on a
# change, never on a draw: a property test once failed CI on a case no earlier run had drawn.
# `RLKIT_HYPOTHESIS=explore bash tools/test.sh tests/policies ...` draws fresh examples to look
# for new failures before a change lands (README).
settings.register_profile("rlkit", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("RLKIT_HYPOTHESIS", "rlkit"))
