"""Pre-warming: an operator asks for at least N GPU pods until a given time, ahead of a
campaign, without editing the Serve config or redeploying (docs/operations.md, "Pre-warming").

The request is the optional ConfigMap `prewarm` (keys `pods` and `until`, an ISO 8601 time
with its zone) that the Ray head mounts at the autoscaling policy's `prewarm_dir`
(base/rayservice.yaml; `make prewarm` writes it, tools/prewarm.py). The policy
(autoscaling.py) reads it at most once a second and holds `pods` as a floor until `until`
passes: undone by the clock, nothing to clean up. A request that cannot be read is ignored
with an error in the controller's log and on the gauge `sonic_ray_prewarm_invalid`; the floor
in force is the gauge `sonic_ray_prewarm_pods` (the dashboard's Scaling row).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

logger = logging.getLogger("ray.serve")

# The ConfigMap the head mounts (invariant prewarm-mounted) and its keys, files of the
# mounted directory.
CONFIG_MAP = "prewarm"
PODS_KEY = "pods"
UNTIL_KEY = "until"
READ_EVERY_S = 1.0


class PrewarmError(ValueError):
    """A pre-warm request that cannot be read; the message says which key and why."""


@dataclass(frozen=True)
class Prewarm:
    pods: int
    until: datetime

    def floor(self, now: datetime) -> int:
        """The GPU pods this request holds at `now`: 0 once its time has passed."""
        return self.pods if now < self.until else 0

    def describe(self) -> str:
        return f"at least {self.pods} GPU pod(s) until {self.until.isoformat()}"


def parse(pods: str, until: str, names: tuple[str, str] = (PODS_KEY, UNTIL_KEY)) -> Prewarm:
    """A request from the ConfigMap's two values; `names` are what the messages call them."""
    text = pods.strip()
    if not text.isdigit() or int(text) < 1:
        raise PrewarmError(f"{names[0]}={pods.strip()!r} is not a whole number of GPU pods of 1 "
                           "or more")
    try:
        when = datetime.fromisoformat(until.strip().replace("Z", "+00:00"))
    except ValueError:
        raise PrewarmError(f"{names[1]}={until.strip()!r} is not an ISO 8601 time (for example "
                           "2026-12-02T18:00:00Z)") from None
    if when.tzinfo is None:
        raise PrewarmError(f"{names[1]}={until.strip()!r} has no time zone (add Z for UTC or an "
                           "offset such as +01:00)")
    return Prewarm(int(text), when.astimezone(UTC))


def read(directory: Path) -> Prewarm | None:
    """The request in `directory` (the mounted ConfigMap), None when there is none: no
    directory or neither key, as while the optional ConfigMap does not exist."""
    pods, until = directory / PODS_KEY, directory / UNTIL_KEY
    present = [p.exists() for p in (pods, until)]
    if not any(present):
        return None
    if not all(present):
        missing = UNTIL_KEY if present[0] else PODS_KEY
        raise PrewarmError(f"the ConfigMap has no `{missing}`: a request needs both "
                           f"`{PODS_KEY}` and `{UNTIL_KEY}`")
    return parse(pods.read_text(), until.read_text())


class PrewarmReader:
    """The request in force, re-read at most every READ_EVERY_S; each change is logged once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.error: str | None = None
        self._request: Prewarm | None = None
        self._read_at = -float("inf")
        self._said = ""

    def floor(self, now: datetime | None = None) -> int:
        if time.monotonic() - self._read_at >= READ_EVERY_S:
            self._read_at = time.monotonic()
            self._refresh()
        if self._request is None:
            return 0
        return self._request.floor(now or datetime.now(UTC))

    def _refresh(self) -> None:
        try:
            self._request, self.error = read(self.directory), None
        except (PrewarmError, OSError) as error:
            self._request, self.error = None, f"pre-warm request in {self.directory} ignored: {error}"
        said = self.error or (self._request.describe() if self._request else "")
        if said != self._said:
            self._said = said
            if self.error:
                logger.error("TritonQueueTimePolicy: %s", self.error)
            elif self._request:
                logger.info("TritonQueueTimePolicy: pre-warm: %s", said)
            else:
                logger.info("TritonQueueTimePolicy: pre-warm: none")
