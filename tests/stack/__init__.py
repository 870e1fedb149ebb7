"""Tests on a running local stack (make local's, on ports of their own)."""
