"""The `fleetserve.v1.FleetServe` gRPC service (service.py: the ingress's RPC methods and
the servicer Serve's gRPC proxy registers) and its proto with the generated modules (proto/)."""
