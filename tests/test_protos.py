"""The committed gRPC stubs are exactly what the generator makes from the .proto files."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc_tools")


def test_stubs_are_fresh(tmp_path):
    from pagedserve.protos.generate import OUT_DIR, generate

    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = OUT_DIR / path.name
        assert committed.is_file(), f"{committed.name} is not committed: run python -m pagedserve.protos.generate"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m pagedserve.protos.generate")


def test_stubs_import_and_describe_the_service():
    from pagedserve.protos import SERVICE_NAME, pagedserve_pb2, pagedserve_pb2_grpc

    service = pagedserve_pb2.DESCRIPTOR.services_by_name["PagedServe"]
    assert service.full_name == SERVICE_NAME
    assert {m.name for m in service.methods} == {"Generate", "Chat", "Tokenize", "ModelInfo", "Health"}
    assert hasattr(pagedserve_pb2_grpc, "add_PagedServeServicer_to_server")
