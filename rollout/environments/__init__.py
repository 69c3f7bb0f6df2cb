"""Environments a multi-turn rollout steps with the model's turns (issue 22): the protocol
(`protocol.py`), tool calls run with bounded concurrency and a timeout (`tools.py`), and the
built-ins: a calculator tool for the arithmetic data (`calculator.py`) and a number-guessing
game whose episodes vary widely in turns (`guess_number.py`). Resolved through the one plugin
rule (rlkit/plugins.py, kind "environment", entry point group `rlkit.environments`)."""
