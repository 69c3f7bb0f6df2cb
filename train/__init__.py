"""Training side: the Trainer protocol, batch building, algorithms, the megatron-core backend,
HF <-> Megatron conversion, weight sync to engines, checkpoints. Heavy modules (megatron, ray)
are imported by their own submodules only."""
