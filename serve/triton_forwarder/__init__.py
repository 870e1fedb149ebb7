from .rpcs import RPCS, SERVICE

__all__ = ["RPCS", "SERVICE"]
