"""Simulation in virtual time: simulated engines, length traces, profiles, a train-time model.

Pure Python plus numpy: nothing here imports torch, Ray or an HTTP library. See
docs/simulation.md.
"""
