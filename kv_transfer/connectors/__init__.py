"""The connectors, each a `Transport` under the shared halves (kv_transfer.transfer), by
registered name (kv_transfer.registry):

* `shared_storage`: ``SharedStorageConnector``, a folder of blocks named by chain key (a
  persistent prefix cache shared by replicas and restarts);
* `ray_store`: ``RayObjectStoreConnector``, Ray's object store, exports held by the owner
  actor (`ray_owner`);
* `p2p`: ``P2PConnector``, torch.distributed pulls from the producer's ranks (gloo, or NCCL
  between GPUs), servers found through the owner actor's directory;
* `faults`: ``FaultInjectionConnector``, one of the others broken on purpose (tests, drills).

Nothing is imported here: a connector's module is imported when it is named.
"""
