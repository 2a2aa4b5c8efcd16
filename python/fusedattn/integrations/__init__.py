"""Integrations with other libraries (optional dependencies, imported on demand)."""
