"""The gRPC stubs generated from protos/pagedserve/v1/ (committed; `python -m pagedserve.protos.generate`
rewrites them, and a test checks they are fresh), and the reflection hook for Ray Serve's gRPC proxy."""

from __future__ import annotations

SERVICE_NAME = "pagedserve.v1.PagedServe"
# The environment variable that holds the API key(s): the server's (comma-separated) and the SDK's and CLI's.
API_KEY_ENV = "PAGEDSERVE_API_KEY"


def add_reflection_to_server(servicer: object, server: object) -> None:
    """A `grpc_servicer_functions` entry (Serve calls each with a servicer and the proxy's server):
    turns on server reflection, so `grpcurl -plaintext HOST:PORT list` and `describe` work."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
