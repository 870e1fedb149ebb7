"""Tests on `make cluster`: the gateway path on the cluster's mechanics (root)."""
