"""What a topology reserves from Ray, and the embedded Ray sized to hold it."""

from __future__ import annotations

from fleetserve.cluster.config import AppConfig
from fleetserve.cluster.topology import embedded_num_cpus, resource_needs


def config(**kw) -> AppConfig:
    engine = {k: kw.pop(k) for k in ("tensor_parallel_size", "device") if k in kw}
    return AppConfig.model_validate({**kw, "engine": engine})


def test_tp_ranks_count_on_top_of_each_replica():
    needs = resource_needs(config(num_replicas=2, tensor_parallel_size=3))
    assert (needs.cpus, needs.gpus) == (8, 0)
    assert needs.describe(2) == ("8 CPUs (2 replicas x (1 CPU for the replica + 3 tensor-parallel ranks x 1 CPU))")
    assert resource_needs(config(num_replicas=3, num_cpus_per_replica=0)).cpus == 0
    gpu = resource_needs(config(num_replicas=1, tensor_parallel_size=2, device="cuda"))
    assert (gpu.cpus, gpu.gpus) == (3, 2) and "1 GPU" in gpu.describe(1)


def test_the_embedded_ray_holds_the_topology_even_on_fewer_cores(caplog):
    import os

    cores = os.cpu_count() or 1
    big = config(num_replicas=1, tensor_parallel_size=cores + 2)
    assert embedded_num_cpus(big) == cores + 3  # the case: TP ranks were left out
    assert "share" in caplog.text
    assert embedded_num_cpus(config(num_replicas=1)) == cores


def test_embedded_replicas_split_the_cores_unless_told(monkeypatch):
    from fleetserve.cluster import topology

    monkeypatch.setattr(topology, "_cores", lambda: 8)
    split = topology.split_cores
    assert split(config(num_replicas=1)).num_cpus_per_replica == 8  # one replica: every core
    assert split(config(num_replicas=3)).num_cpus_per_replica == 2
    assert split(config(num_replicas=16)).num_cpus_per_replica == 1
    assert split(config(num_replicas=2, num_cpus_per_replica=0)).num_cpus_per_replica == 0
    assert split(config(num_replicas=1, address="auto")).num_cpus_per_replica is None  # joined
    assert split(config(num_replicas=1, tensor_parallel_size=2)).num_cpus_per_replica == 1
    pd = config(pd={"enabled": True, "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 3}})
    assert split(pd).num_cpus_per_replica == 2
    scaled = config(autoscaling={"min_replicas": 1, "max_replicas": 4})
    assert split(scaled).num_cpus_per_replica == 2  # sized for the ceiling
    needs = resource_needs(split(config(num_replicas=2)))
    assert needs.cpus == 8 and embedded_num_cpus(split(config(num_replicas=2))) >= 8
    # unset outside an embedded Ray (a Serve config, Helm): 1 CPU each, as before
    assert resource_needs(config(num_replicas=2)).cpus == 2
