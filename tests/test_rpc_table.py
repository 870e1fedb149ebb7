"""Our RPC table against tritonclient's own service descriptor: a protocol change in Triton
(a new, renamed or re-typed RPC) fails here."""

from tritonclient.grpc import service_pb2

from triton_forwarder.rpcs import REFUSABLE, RPCS, SERVICE


def test_table_matches_tritonclient_descriptor() -> None:
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == SERVICE
    theirs = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    ours = {rpc.name: (rpc.streaming, rpc.streaming) for rpc in RPCS}
    assert ours == theirs


def test_refused_by_default_are_the_load_balancer_hazards() -> None:
    assert frozenset({
        "RepositoryModelLoad", "RepositoryModelUnload",
        "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
        "TraceSetting", "LogSettings",
    }) == REFUSABLE


def test_rpcs_in_tritons_restricted_groups_are_marked() -> None:
    # --grpc-restricted-protocol=model-repository,shared-memory,trace,logging
    restricted = {rpc.name for rpc in RPCS if rpc.restricted}
    assert restricted == REFUSABLE | {
        "RepositoryIndex", "SystemSharedMemoryStatus", "CudaSharedMemoryStatus"}
