"""Which engine replica serves a request, and what happens when it fails.

request_router.py  Ray Serve's custom request router, driven by a policy (policies/)
registry.py        this process's request routers, by deployment (the ingress looks them up)
policies/          the routing policies behind one interface (load, prefix, adapters)
kv_index.py        the router's index of the blocks each replica caches (prefix routing)
kv_subscriber.py   feeds that index from the engines' KV events
pd.py              prefill/decode disaggregation: decode replica first, then a prefill
prefix_reuse.py    a prefix another replica caches, handed over instead of recomputed
migration.py       a stream whose replica dies goes on elsewhere
admission.py       the replica's KV-aware admission (429 before a request only waits)
slo.py             SLO-aware admission: predicted TTFT/ITL per replica, early 429 (the simulator runs it too)
"""
