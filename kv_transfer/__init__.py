"""KV transfer: move a request's KV cache between engines (vLLM v1's connector contract).

One connector class, built once per role (``KVConnectorRole``):

* the **scheduler half** runs inside the EngineCore next to the scheduler
  (contract: ``fleetserve.scheduler.connector.KVConnectorScheduler``): it decides
  what a request can load, parks it in ``WAITING_FOR_REMOTE_KVS``, builds the
  per-step metadata, and keeps a finished producer request's blocks until they
  were copied out (``delay_free``);
* the **worker half** runs wherever the KV lives (the engine-core process for
  TP=1, every rank for TP>1; contract: ``kv_transfer.base.KVConnectorWorker``).
  Per step, around the forward pass (``kv_transfer.base.run_connector_step``):
  ``bind_connector_metadata`` -> ``start_load_kv`` -> forward ->
  ``wait_for_save`` -> ``get_finished(finished_ids)`` ->
  ``get_block_ids_with_load_errors`` -> ``clear_connector_metadata``. It also runs
  in steps that schedule no tokens, so pending transfers keep moving.

Connectors, by registered name or ``"module:Class"`` (``kv_transfer.factory``):
``SharedStorageConnector`` (a folder: a persistent prefix cache shared by
replicas and restarts), ``RayObjectStoreConnector`` (Ray's object store),
``P2PConnector`` (torch.distributed gloo pulls from the producer rank), and
``FaultInjectionConnector`` (wraps one of them and breaks it on purpose).

Configuration, as vLLM: ``--kv-transfer-config '{"kv_connector":
"SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"path": "/mnt/kv"}, "kv_load_failure_policy": "recompute"}'`` on the CLI,
``engine: {kv_transfer_config: {...}}`` in the app YAML, or
``EngineArgs(kv_transfer_config={...})`` (schema: ``kv_transfer.config.KVTransferConfig``).

Engine-facing API (what the router / P-D code calls; stable)
------------------------------------------------------------
``kv_transfer_params`` is a keyword of ``AsyncEngine.generate`` only; it is never
read from ``SamplingParams`` or from a request body: the router decides whether a
client may send it (refuse by default) and passes it explicitly. It is a plain
JSON-able dict, validated by ``kv_transfer.params.validate_kv_transfer_params``
(a bad one raises ``ValueError`` from ``generate`` before anything is queued;
an engine without a connector refuses any).

1. Producer (prefill) engine: the caller mints a ``transfer_id`` (the transfer's
   identity; never an engine-internal request id)::

       async for out in engine_p.generate(prompt, SamplingParams(max_tokens=1),
               kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}):
           ...
       params = out.kv_transfer_params   # on the final RequestOutput

   ``params`` is ``None`` when there is nothing to hand over (the prompt has no
   full block, the request was aborted or failed). Otherwise a dict to pass on
   unchanged::

       {"do_remote_prefill": True, "transfer_id": tid,
        "remote_engine_id": "...", "remote_connector": "RayObjectStoreConnector",
        "remote_num_tokens": 512,          # prompt tokens (whole blocks) exported
        "remote_block_size": 16, "remote_tp_size": 1,
        "remote_lease_s": 30.0,            # the producer keeps them this long
        ...connector-specific "remote_*" keys (where the blocks are)}

   The producer keeps the exported KV under a lease (``kv_lease_s``): released
   when the consumer confirms, or when the lease ends.

2. Consumer (decode) engine: the same prompt, with those params::

       async for out in engine_d.generate(prompt, sp, kv_transfer_params=params): ...

   The request waits in ``WAITING_FOR_REMOTE_KVS`` (deadline ``kv_load_timeout_s``)
   while its worker pulls the blocks, checks every block's chain key (a hash of
   the prompt's tokens up to that block and of a model/dtype/block-size/layout
   fingerprint) against its own prompt, and then decodes. A missing, late,
   corrupt or foreign block is a failed load: with ``kv_load_failure_policy:
   recompute`` the request recomputes from the first bad block (slower, right
   tokens); with ``fail`` it ends with ``finish_reason == "error"`` so the router
   can retry elsewhere. Wrong KV never produces tokens.

3. Every final ``RequestOutput`` reports ``num_cached_tokens`` (prompt tokens not
   computed here: local prefix cache + remote) and ``num_remote_tokens`` (of
   those, the tokens whose KV was loaded through the connector). Tokens computed
   locally = ``len(prompt_token_ids) - num_cached_tokens``.

A shared-storage connector with ``kv_role`` ``kv_both``/``kv_producer`` also
stores every finished request's full blocks and loads any stored prefix for any
request (no params needed): a prefix cache shared across replicas and restarts.

A finished request's save is queued for the step after it; the engine runs that
step (and polls the export) without waiting for more requests: an engine is idle
only once its connector has nothing pending (``KVConnectorScheduler.has_pending_work``,
``KVConnectorWorker.num_saves_in_flight``). The offline ``LLM.generate`` returns
once its requests' saves are written, and an engine shutting down finishes them
first; either waits at most ``kv_save_timeout_s`` and then reports how many are
left (a warning; at shutdown they are dropped and counted in
``vllm:kv_transfer_dropped_saves``, with saves whose export failed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # re-exported lazily: importing the package must not import torch
    from fleetserve.kv_transfer.base import KVConnectorBase, KVConnectorRole, KVConnectorWorker
    from fleetserve.kv_transfer.config import KVTransferConfig
    from fleetserve.kv_transfer.factory import make_connector
    from fleetserve.kv_transfer.params import validate_kv_transfer_params

_LAZY = {
    "KVConnectorBase": "fleetserve.kv_transfer.base",
    "KVConnectorRole": "fleetserve.kv_transfer.base",
    "KVConnectorWorker": "fleetserve.kv_transfer.base",
    "KVTransferConfig": "fleetserve.kv_transfer.config",
    "make_connector": "fleetserve.kv_transfer.factory",
    "validate_kv_transfer_params": "fleetserve.kv_transfer.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleetserve.kv_transfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "KVConnectorBase",
    "KVConnectorRole",
    "KVConnectorWorker",
    "KVTransferConfig",
    "make_connector",
    "validate_kv_transfer_params",
]
