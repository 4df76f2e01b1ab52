"""The tenant a request's body names reaches the scheduler's Request (engine/processor.py),
for each of its n samples; without one it is the default tenant."""

from __future__ import annotations

from types import SimpleNamespace

from fleetserve.replica.engine.processor import InputProcessor
from fleetserve.scheduler import SamplingParams


def test_tenant_and_weight_reach_every_request():
    proc = InputProcessor(SimpleNamespace(eos_token_id=0), max_model_len=64, vocab_size=100)
    _, reqs = proc.process([5, 6, 7], SamplingParams(max_tokens=2, n=2), "r", tenant="acme", tenant_weight=3.0)
    assert [(r.tenant, r.tenant_weight) for r in reqs] == [("acme", 3.0), ("acme", 3.0)]
    _, (plain,) = proc.process([5, 6, 7], SamplingParams(max_tokens=2), "s")
    assert (plain.tenant, plain.tenant_weight) == ("default", 1.0)


def test_session_and_predicted_length_reach_every_request():
    from fleetserve.router.replica import _length_kwargs

    body = {"session": "chat-7", "predicted_output_tokens": 40}
    kwargs = _length_kwargs(body)
    assert kwargs == {"session": "chat-7", "predicted_output_tokens": 40}
    # A prediction that is not a positive integer is dropped, not sent on.
    assert _length_kwargs({"predicted_output_tokens": 0}) == _length_kwargs({"predicted_output_tokens": True}) == {}
    proc = InputProcessor(SimpleNamespace(eos_token_id=0), max_model_len=64, vocab_size=100)
    _, reqs = proc.process([5, 6, 7], SamplingParams(max_tokens=50, n=2), "r", **kwargs)
    assert [(r.session, r.predicted_output_tokens) for r in reqs] == [("chat-7", 40)] * 2
    _, (plain,) = proc.process([5, 6, 7], SamplingParams(max_tokens=2), "s")
    assert (plain.session, plain.predicted_output_tokens) == (None, None)
