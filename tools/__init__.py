"""Generators of committed files (make generate) and the operator's pre-warm command (make prewarm)."""
