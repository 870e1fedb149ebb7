"""make cluster: the gateway path on the cluster's mechanics (local_stack/cluster/stack.py)."""
