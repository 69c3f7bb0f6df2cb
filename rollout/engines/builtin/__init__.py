"""rlkit's built-in engine server: the CPU (and one-GPU) stand-in for SGLang, speaking the same
HTTP protocol behind the same router and clients (docs/engines.md). A server process started by
module name (`python -m rlkit.rollout.engines.builtin.hf_server`, rollout/engines/process.py);
nothing in the runtime imports it."""
