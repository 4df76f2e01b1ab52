"""The fleet simulator: the real scheduler and router policies in virtual time.

Every replica runs the real `fleetserve.scheduler.Scheduler`; the router runs the real
routing policies of `fleetserve.router.routing.policies`. Only the model forward, the
KV transfer and the network are cost models (`profile.py`), fed by step shapes
(`shape.py`). Traces and their generators live in `traces.py`. This package imports the
others; nothing imports it (DESIGN.md).
"""
