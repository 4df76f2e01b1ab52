"""The serving front: Ray Serve deployments, the OpenAI HTTP and gRPC APIs, routing.

    client --HTTP/gRPC--> Serve proxy --> ingress (router/ingress.py: validate, tokenize)
                                            | handle.generate, routed by FleetRequestRouter
                                            v  (router/routing/request_router.py + router/routing/policies/)
                                          engine replica x N (router/replica.py: AsyncEngine)

See router/README.md for the design of routing and metrics aggregation.
"""
