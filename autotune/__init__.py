"""Tuning spaces, and (to come) timing, the correctness gate, the result store and sweeps."""
