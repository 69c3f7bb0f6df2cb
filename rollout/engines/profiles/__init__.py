"""Engine profiles shipped as package data (JSON, see rollout.engines.profile)."""
