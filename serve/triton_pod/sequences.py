"""Stateful models on the Serve path (docs/data-paths.md, "Sequences"): Triton's sequence
batcher keeps a sequence's state in the Triton that got its START and refuses the sequence's
later calls anywhere else, unrun, in SEQUENCE_NOT_HELD's words. Serve's router balances each
call on its own, so a ModelInfer, or an HTTP infer, that its pod's Triton refuses so is asked
of the other replicas (`infer_if_held` and `http_if_held` in pod.py, each question routed to a
replica not asked yet by routing.py), each Triton once, until the one holding the sequence
runs it; when none does, the client gets the refusal. Calls that are not refused so cost
nothing more (an HTTP infer's body is kept, up to KEPT_BYTES, while it streams to Triton, and
past that only when it names a sequence); a ModelStreamInfer stream stays on one Triton anyway."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

# Triton's words (grpc-message, and over HTTP the error body) for a call of a sequence whose
# START it never saw; gateway/routes.py retries on the same words.
SEQUENCE_NOT_HELD = "must specify the START flag"
# The one RPC whose calls carry a sequence and are asked elsewhere.
SEQUENCE_RPC = "ModelInfer"
# Each question goes to a replica not asked yet (routing.py); one that went away meanwhile may
# leave only asked ones, which answer at once: this many questions per replica, at most,
# before the refusal stands.
PICKS_PER_REPLICA = 2
# The HTTP paths of an inference, whose refusal (400) is asked elsewhere.
HTTP_INFER_PATH = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")
HTTP_REFUSED_STATUS = 400
# An HTTP infer's body is kept for asking elsewhere up to this size, as the gateway keeps a
# request for a retry (gateway/envoy.yaml's per-request buffer); a larger one's refusal stands.
KEPT_BYTES = 1 << 20
# Once passed, the body is kept only when its JSON header holds this key (the parameter that
# names a call's sequence, written so by Triton's clients), the header being the first
# INFERENCE_HEADER_LENGTH bytes of a binary-tensor request and all of a JSON one.
SEQUENCE_ID_KEY = b'"sequence_id"'
INFERENCE_HEADER_LENGTH = "inference-header-content-length"


class Asked(Protocol):
    """What held_elsewhere reads of an answer."""

    @property
    def replica(self) -> str: ...
    @property
    def asked_before(self) -> bool: ...
    @property
    def not_held(self) -> bool: ...


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


@dataclass(frozen=True)
class HttpAnswer:
    """One replica's answer to an HTTP infer asked of it, as Answer is to a ModelInfer: its
    Triton's status, the headers a client gets, and its body."""

    replica: str
    asked_before: bool = False
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    @property
    def not_held(self) -> bool:
        return http_not_held(self.status, self.body)


def http_not_held(status: int, body: bytes) -> bool:
    """Whether Triton refused an HTTP infer as one of a sequence it does not hold."""
    return status == HTTP_REFUSED_STATUS and SEQUENCE_NOT_HELD.encode() in body


AnswerT = TypeVar("AnswerT", bound=Asked)


async def held_elsewhere(ask: Callable[[list[str]], Awaitable[AnswerT]], me: str,
                         replicas: int) -> AnswerT | None:
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
