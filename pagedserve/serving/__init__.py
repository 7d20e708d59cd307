"""The Ray Serve front end: the engine deployment (`ModelServer`), the ingress with its gRPC service and
OpenAI routes, the prefix-aware router, and `serve_app.build_app`. The executors are in `pagedserve.executors`."""
