"""The megatron-core backend. Import submodules directly; this package imports nothing heavy."""
