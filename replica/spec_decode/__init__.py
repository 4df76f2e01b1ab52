"""Speculative decoding on the worker side: proposers and the draft-token rules.

    spec_decode/config.py       SpeculativeConfig (vLLM's --speculative-config JSON)
    spec_decode/proposer.py     the Proposer interface, ProposeInput
    spec_decode/factory.py      make_proposer: the proposer a config names
    spec_decode/ngram.py        prompt lookup (no extra model), numpy
    spec_decode/draft_model.py  a small model sharing the tokenizer, own KV cache

The scheduler's half lives in scheduler/spec_decode.py; verification is in
the model runner (worker/model_runner.py, `_sample_and_verify`).
"""
