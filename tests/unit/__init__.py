"""Unit tests: no process beyond the test's own (make unit runs these)."""
