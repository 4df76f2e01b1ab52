"""`--kv-transfer-config`: which connector, which role, what to do when a load fails.

Field names are vLLM's (`KVTransferConfig`); `kv_lease_s`, `kv_load_timeout_s` and
`kv_save_timeout_s` are ours: every held block has a lease and every wait a deadline. Pure pydantic
(no torch), so the engine arguments can validate it anywhere.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetserve.kv_transfer.registry import check_connector_name, check_connector_options

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A registered or short name (kv_transfer.registry) or "package.module:Class".
    kv_connector: str = Field(..., min_length=1)
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # vLLM's default moved from recompute to fail: a recompute runs a prefill
    # on a decode-tuned engine; fail lets the router retry elsewhere. Loads the
    # connector found on its own (a shared-storage prefix hit) always recompute.
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    # A producer keeps exported KV this long unless the consumer confirms first.
    kv_lease_s: float = Field(30.0, gt=0)
    # A request waits at most this long in WAITING_FOR_REMOTE_KVS.
    kv_load_timeout_s: float = Field(30.0, gt=0)
    # Saves still pending when an engine flushes them (the offline LLM's generate returning,
    # an engine shutting down) get this long to finish; past it they are reported (a warning,
    # vllm:kv_transfer_dropped_saves) and, at shutdown, dropped. Below the 30 s a replica
    # gives its engine-core process to exit.
    kv_save_timeout_s: float = Field(10.0, gt=0)
    # Names this engine in the params it hands out; minted at start-up when unset.
    engine_id: Optional[str] = Field(None, min_length=1, max_length=128)

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, v: str) -> str:
        # Checked where the config is parsed (a CLI flag, the app YAML), not first in every
        # engine replica at start-up. Short names (p2p, ray_object_store, ...) are kept as given.
        check_connector_name(v)
        return v

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _json_only(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_connector_extra_config must be plain JSON: {e}") from e
        return v

    @model_validator(mode="after")
    def _connector_options(self) -> "KVTransferConfig":
        check_connector_options(self.kv_connector, self.kv_connector_extra_config)
        return self

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
