"""Trajectory trees, provenance, request classes (pure: no I/O)."""
