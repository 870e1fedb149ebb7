"""The RPC table of Triton's `inference.GRPCInferenceService`, kept here rather than read from
tritonclient: the Ray containers run the official Ray image, which has no tritonclient.
tests/unit/test_rpc_table.py checks it against tritonclient's own service descriptor."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class Rpc:
    name: str
    streaming: bool = False
    # Why the RPC is wrong behind a load balancer; empty when it is safe to forward.
    refusal: str = ""
    # In one of the protocol groups Triton restricts (--grpc-restricted-protocol): the forwarder
    # sends the admin key with it.
    restricted: bool = False
    # The same call in Triton's HTTP/REST API: a regular expression (RE2 and Python alike) that
    # the whole URL path matches; only RPCs that are refused or restricted need one.
    http_path: str = ""

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"

    def refused(self, allowed: Collection[str]) -> bool:
        """Refused on both data paths, unless the Serve config's allowed_admin_rpcs names it."""
        return bool(self.refusal) and self.name not in allowed


_ONE_REPLICA = (
    "it would change the model repository of only the one Triton replica that this call "
    "happens to reach, so replicas would serve different models"
)
_SHARED_MEMORY = (
    "shared memory is memory on the client's host, which a Triton in a remote pod cannot see"
)
# One path segment, and the optional region segment of Triton's shared-memory endpoints.
_NAME = "[^/]+"
_REGION = f"(/region/{_NAME})?"
_ONE_POD = "it would change the settings of only the one Triton replica that this call reaches"

RPCS: tuple[Rpc, ...] = (
    Rpc("ServerLive"),
    Rpc("ServerReady"),
    Rpc("ModelReady"),
    Rpc("ServerMetadata"),
    Rpc("ModelMetadata"),
    Rpc("ModelInfer"),
    Rpc("ModelStreamInfer", streaming=True),
    Rpc("ModelConfig"),
    Rpc("ModelStatistics"),
    Rpc("RepositoryIndex", restricted=True, http_path="/v2/repository/index"),
    Rpc("RepositoryModelLoad", refusal=_ONE_REPLICA, restricted=True,
        http_path=f"/v2/repository/models/{_NAME}/load"),
    Rpc("RepositoryModelUnload", refusal=_ONE_REPLICA, restricted=True,
        http_path=f"/v2/repository/models/{_NAME}/unload"),
    # Status, Register, Unregister of the system and the CUDA shared memory alike.
    *(Rpc(f"{kind}SharedMemory{verb}", refusal="" if verb == "Status" else _SHARED_MEMORY,
          restricted=True, http_path=f"/v2/{kind.lower()}sharedmemory{_REGION}/{verb.lower()}")
      for kind in ("System", "Cuda") for verb in ("Status", "Register", "Unregister")),
    Rpc("TraceSetting", refusal=_ONE_POD, restricted=True,
        http_path=f"/v2(/models/{_NAME}(/versions/{_NAME})?)?/trace/setting"),
    Rpc("LogSettings", refusal=_ONE_POD, restricted=True, http_path="/v2/logging"),
)

BY_NAME: dict[str, Rpc] = {rpc.name: rpc for rpc in RPCS}
HTTP_RESTRICTED: tuple[Rpc, ...] = tuple(rpc for rpc in RPCS if rpc.http_path)
REFUSABLE: frozenset[str] = frozenset(rpc.name for rpc in RPCS if rpc.refusal)


def refusal_message(rpc: Rpc) -> str:
    return (
        f"{rpc.name} is refused by this endpoint: {rpc.refusal}. An operator who wants it "
        f'anyway adds "{rpc.name}" to allowed_admin_rpcs in the application\'s args in the '
        "Serve config, which both data paths follow (make gateway-config writes the gateway's "
        "routes from it)."
    )
