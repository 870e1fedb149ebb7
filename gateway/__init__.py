"""The gateway: Envoy's config and Lua, the writer of its refused-RPC routes (routes.py), its
Kubernetes objects, and how this machine runs it (local.py)."""
