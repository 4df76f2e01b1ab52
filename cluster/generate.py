"""`fleetserve generate`: one-shot offline generation with the in-process engine (no Ray
for TP=1).

    fleetserve generate "The capital of France is" --max-tokens 20
    fleetserve generate --chat "Tell me a joke" --temperature 0.7 --seed 1

`--seed` is the engine's seed (vLLM's flag): with it, sampled runs repeat exactly.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from fleetserve.cluster.cli_engine import add_engine_flags, engine_kwargs


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text offline from a prompt (no server)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    add_engine_flags(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from fleetserve.replica.model_loader.registry import ModelNotFoundError
    from fleetserve.scheduler import SamplingParams

    try:
        sp = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            max_tokens=args.max_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"fleetserve generate: {e}", file=sys.stderr)
        return 2
    try:
        from fleetserve.replica.llm import LLM
        from fleetserve.replica.model_loader.model_info import check_model_files
        from fleetserve.replica.model_loader.registry import resolve_model

        kwargs = engine_kwargs(args)
        if kwargs.get("model"):  # (unset: the default model, which the package ships whole)
            check_model_files(resolve_model(kwargs["model"]))  # before the tokenizer reads it
        llm = LLM(**kwargs)
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], sp, use_tqdm=not args.quiet)
        else:
            outs = llm.generate(args.prompt, sp, use_tqdm=not args.quiet)
    except (ValidationError, ModelNotFoundError, ValueError) as e:
        print(f"fleetserve generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outs):
        for c in out.outputs:
            if args.quiet:
                print(c.text)
            else:
                print(f"--- {prompt!r} -> [{c.finish_reason}, {len(c.token_ids)} tokens]")
                print(c.text)
    return 0


__all__ = ["add_generate_parser", "cmd_generate"]
