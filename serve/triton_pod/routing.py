"""Serve's router for the TritonPod deployment (the Serve config's `request_router_config`):
Serve's own power-of-two-choices router, except for a question that a replica asks the others
about a call of a sequence its Triton does not hold (sequences.py), which goes to a replica
not asked yet. Left to power of two choices, such a question goes to the replica whose queue
looks shorter: under load the asking one, never the busy holder (docs/data-paths.md,
"Sequences")."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

try:
    # Serve's default router; its module is private, so a Ray that moved it fails the deploy
    # here, saying so, rather than routing otherwise.
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
except ImportError as error:  # pragma: no cover - only with another Ray than the pinned one
    raise ImportError(f"triton_pod.routing needs Ray's PowerOfTwoChoicesRequestRouter (pinned "
                      f"Ray: requirements.txt): {error}") from error

# The keyword argument that carries the replicas asked so far (pod.py, infer_if_held and
# http_if_held).
ASKED = "asked"


def asked_of(pending_request: PendingRequest | None) -> list[str] | None:
    """The replicas a question about a sequence was asked of already; None for any other
    request."""
    if pending_request is None:
        return None
    asked: Any = pending_request.kwargs.get(ASKED)
    return list(asked) if isinstance(asked, list) else None


class SequenceRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        asked = asked_of(pending_request)
        if asked is None:
            chosen: list[list[RunningReplica]] = await super().choose_replicas(
                candidate_replicas, pending_request)
            return chosen
        others = [r for r in candidate_replicas if r.replica_id.unique_id not in asked]
        # None left (one went away since the question was sent): any replica, which answers
        # that it was asked before, and the asking replica stops.
        return [others or list(candidate_replicas)]
