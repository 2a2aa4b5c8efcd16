"""Build helpers shared by setup.py (ahead-of-time build) and the first-use (JIT) build of
fusedattn._C: stdlib only, so setup.py can load them from the source tree."""
