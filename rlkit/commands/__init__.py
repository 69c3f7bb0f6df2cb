"""CLI command modules (see rlkit.cli)."""
