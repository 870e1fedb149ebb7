from .rpcs import RPCS, SERVICE

# What the Serve config's application names (import_path); schema/ checks builds against it.
APP_IMPORT_PATH = "triton_pod.pod:build_app"

__all__ = ["APP_IMPORT_PATH", "RPCS", "SERVICE"]
