"""The serving front: Ray Serve deployments, the OpenAI HTTP and gRPC APIs, routing.

    client --HTTP/gRPC--> ingress (router/ingress.py: validate, tokenize)
                            | handle.generate, routed by FleetRequestRouter
                            v  (router/routing/request_router.py + router/routing/policies/)
                          engine replica x N (router/replica.py: AsyncEngine)

The folder, by role:

    ingress.py        the ingress deployment: FastAPI routes (+ the gRPC methods, grpc/)
    settings.py       IngressSettings, what cluster/deploy.py builds the ingress with
    engine_pools.py   the engine deployments behind the ingress: info, P/D or reuse, migration
    bodies.py         API requests -> engine request bodies (tokenized, bounded)
    streams.py        reading a replica's stream (ReplicaStream), to its end
    loras.py          LoRA adapters by name; loading and unloading them at run time
    runtime_loras.py  those loaded at run time, kept in Ray's GCS for a restarted ingress
    metrics.py        every metric the router exports, and the replicas' merged
    health.py         /health: every engine replica asked, outside Serve's queue
    feed.py           the per-step feed: one stream per engine replica for all deltas
    auth.py, cors.py, access_log.py   HTTP middleware
    serve_patches.py  fixes to how Ray Serve 2.60 binds the ingress's own servers
    replica.py        the engine replica deployment (one AsyncEngine each)
    api/              the OpenAI API: request models, bodies, chunks, errors, limits
    grpc/             the gRPC service and its proto
    routing/          request router, policies, KV index, P/D, prefix reuse, migration, admission

The design: docs/design/router.md.
"""
