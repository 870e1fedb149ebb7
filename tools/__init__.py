"""Generators of committed files (make generate)."""
