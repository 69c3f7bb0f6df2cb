"""rlkit."""
