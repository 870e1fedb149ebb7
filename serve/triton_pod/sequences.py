"""Stateful models on the Serve path (docs/data-paths.md, "Sequences"): Triton's sequence
batcher keeps a sequence's state in the Triton that got its START and refuses the sequence's
later calls anywhere else, unrun, in SEQUENCE_NOT_HELD's words. Serve's router balances each
call on its own, so a ModelInfer that its pod's Triton refuses so is asked of the other
replicas (through Serve's own router, `infer_if_held` in pod.py), each Triton once, until the
one holding the sequence runs it; when none does, the client gets the refusal. Calls that are
not refused so cost nothing more; a ModelStreamInfer stream stays on one Triton anyway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

# Triton's words (grpc-message, and over HTTP the error body) for a call of a sequence whose
# START it never saw; gateway/routes.py retries on the same words.
SEQUENCE_NOT_HELD = "must specify the START flag"
# The one RPC whose calls carry a sequence and are asked elsewhere.
SEQUENCE_RPC = "ModelInfer"
# Serve's router picks a replica at random, so one already asked may come again: this many
# picks per replica, at most, before the refusal stands (each repeat answers at once).
PICKS_PER_REPLICA = 10


@dataclass(frozen=True)
class Answer:
    """One replica's answer to a call asked of it: whose, whether it had been asked already
    (then nothing ran), and its Triton's status, details, trailing metadata and reply."""

    replica: str
    asked_before: bool = False
    code: str = "OK"
    details: str = ""
    trailing: tuple[tuple[str, str | bytes], ...] = ()
    reply: bytes = b""

    @property
    def not_held(self) -> bool:
        return not_held(grpc.StatusCode[self.code], self.details)


def not_held(code: grpc.StatusCode, details: str) -> bool:
    """Whether Triton refused a call as one of a sequence it does not hold."""
    return code == grpc.StatusCode.INVALID_ARGUMENT and SEQUENCE_NOT_HELD in details


async def held_elsewhere(ask: Callable[[list[str]], Awaitable[Answer]], me: str,
                         replicas: int) -> Answer | None:
    """The answer of the first other replica whose Triton does not refuse the call as not
    holding its sequence; None once all `replicas` have refused (`me` first) or the picks
    ran out. `ask` gets the replicas asked so far; one of those answers `asked_before`."""
    asked = {me}
    for _ in range(PICKS_PER_REPLICA * replicas):
        if len(asked) >= replicas:
            return None
        answer = await ask(sorted(asked))
        if answer.asked_before:
            continue
        asked.add(answer.replica)
        if not answer.not_held:
            return answer
    return None
