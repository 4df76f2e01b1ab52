"""`fleetserve sim`: replay a trace on a simulated fleet, with the app config of `fleetserve serve`.

    fleetserve sim --trace T.jsonl --profile h100-llama-3.1-8b --num-replicas 8 \\
        --routing-policy prefix_aware [--pd 2:6] [--config app.yaml] --output result.json
    fleetserve sim --generate shared_prefix --num-requests 5000 --request-rate 40 ...
    fleetserve sim ... --sweep num_replicas=4,8,16 --sweep pd=2:6,4:4 --plot sweep.png

Every `fleetserve serve` flag is accepted and means what it means there (one schema:
`cluster/config.py`'s `AppConfig`): the engine flags configure each simulated replica's
real scheduler, `--num-replicas`, `--routing-policy` and `--routing.*` the router, and
`--pd.*` the prefill/decode pools (`--pd P:D` is short for `--pd.enabled true
--pd.prefill.num-replicas P --pd.decode.num-replicas D`). Flags that only matter to a
live server (ports, keys, CORS) are accepted and unused. The model forward, the KV
transfer and the network are the profile's cost model (`fleetserve.sim.profile`;
`fleetserve profile` measures one).

This module is the command line only: the simulator is `fleetserve.sim`, imported inside
the command (nothing that serves imports it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

SWEEP_KEYS = ("num_replicas", "pd", "routing_policy", "max_num_batched_tokens", "request_rate")


def add_sim_parser(sub) -> None:
    from fleetserve.cluster.cli import APP_SKIP
    from fleetserve.cluster.cli_engine import add_engine_flags, add_schema_flags
    from fleetserve.cluster.config import AppConfig

    p = sub.add_parser(
        "sim",
        help="simulate a fleet on a trace: the real scheduler and router in virtual time",
        description="Replay a trace on simulated replicas that run the real scheduler and "
        "routing policies, with the model forward, KV transfer and network replaced by a "
        "step-cost profile. Takes every flag and --config of `fleetserve serve`.",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1],
        # `--pd` below replaces the schema's boolean `--pd` (pd.enabled) with one that also
        # takes the pools' sizes; `--no-pd` stays.
        conflict_handler="resolve",
    )
    p.add_argument("model_tag", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--config", help="application YAML (the schema of `fleetserve serve --config`)")
    add_engine_flags(p)
    add_schema_flags(p.add_argument_group("application"), AppConfig, skip=APP_SKIP)
    g = p.add_argument_group("simulation")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--trace",
        help="the trace: our JSONL, Mooncake JSONL, Azure CSV or BurstGPT CSV (format detected; see --trace-format)",
    )
    src.add_argument(
        "--generate",
        metavar="KIND",
        help="generate the trace instead: poisson, bursty, long_tail, shared_prefix, multiturn or length_mix",
    )
    g.add_argument("--trace-format", help="jsonl, mooncake, azure or burstgpt [default: from the file]")
    g.add_argument("--num-requests", type=int, help="--generate: requests [default: 1000]")
    g.add_argument("--request-rate", type=float, help="--generate: mean arrivals per second [default: 10]")
    g.add_argument(
        "--gen",
        action="append",
        metavar="KEY=VALUE",
        help="--generate: a generator option, e.g. num_tenants=150, system_prompt_tokens=6000, cv=3 (repeatable)",
    )
    g.add_argument(
        "--profile",
        help="a step-cost profile: a shipped name (e.g. h100-llama-3.1-8b) or a JSON path [default: h100-llama-3.1-8b]",
    )
    g.add_argument(
        "--pd",
        dest="pd_ratio",
        nargs="?",
        const="",
        metavar="P:D",
        help="prefill/decode disaggregation on; with P:D, the pools' replica counts (--pd 2:6)",
    )
    g.add_argument(
        "--slo-ttft-s",
        type=float,
        help="goodput's TTFT SLO in seconds (goodput counts requests meeting both) [default: --slo-ttft-ms's]",
    )
    g.add_argument(
        "--slo-itl-s",
        type=float,
        help="goodput's ITL SLO in seconds (a request's mean inter-token time, TPOT, must meet it) "
        "[default: --slo-itl-ms's]; --slo-ttft-ms/--slo-itl-ms also turn SLO-aware admission on",
    )
    g.add_argument("--sim-seed", type=int, help="the simulation's seed (policies, generated traces) [default: 0]")
    g.add_argument("--network-latency-s", type=float, help="router -> replica one-way latency [default: 0.0005]")
    g.add_argument("--kv-event-lag-s", type=float, help="KV event delivery lag to the router [default: 0.05]")
    g.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        help=f"run one point per value (repeatable: the cross product); keys: {', '.join(SWEEP_KEYS)}",
    )
    g.add_argument("--output", "-o", help="result JSON [default: sim_result.json]")
    g.add_argument("--plot", help="--sweep: the PNG plot, goodput vs replicas [default: next to --output]")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sim)


class SimUsageError(ValueError):
    """A bad flag value, trace, profile or config: printed as one message, exit code 2."""


def _pd_ratio(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise SimUsageError(f"--pd {text!r}: expected P:D, two replica counts such as 2:6") from None
    if p < 1 or d < 1:
        raise SimUsageError(f"--pd {text!r}: both pools need at least one replica")
    return p, d


def _gen_options(kind: str, items: list[str]) -> dict[str, Any]:
    """`--gen` options for generator `kind`. A length option (`prompt`, `output`, `user`) takes
    a number (its median) or a JSON object of `Lengths` fields laid over the generator's
    default: `--gen prompt=3000`, `--gen 'output={"median": 256, "hi": 1024}'`."""
    import dataclasses
    import inspect

    from fleetserve.sim.generators import GENERATORS, Lengths

    params = inspect.signature(GENERATORS[kind]).parameters if kind in GENERATORS else {}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SimUsageError(f"--gen {item!r}: expected KEY=VALUE")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        default = params[key].default if key in params else None
        if isinstance(default, Lengths):
            fields = {"median": parsed} if isinstance(parsed, (int, float)) else parsed
            if not isinstance(fields, dict):
                raise SimUsageError(f"--gen {item!r}: a length is a number (its median) or a JSON object")
            try:
                parsed = dataclasses.replace(default, **fields)
            except TypeError as e:
                names = ", ".join(f.name for f in dataclasses.fields(Lengths))
                raise SimUsageError(f"--gen {item!r}: {e} (a length has {names})") from None
        out[key] = parsed
    return out


def parse_sweep(items: list[str]) -> list[dict[str, Any]]:
    """`["num_replicas=4,8", "pd=1:3,2:2"]` -> the cross product as a list of point dicts."""
    axes: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SWEEP_KEYS:
            raise SimUsageError(f"--sweep {item!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
        parsed: list[Any] = []
        for v in (x.strip() for x in values.split(",")):
            if not v:
                raise SimUsageError(f"--sweep {item!r}: an empty value")
            if key == "pd":
                parsed.append(_pd_ratio(v))
            elif key == "routing_policy":
                parsed.append(v)
            elif key == "request_rate":
                parsed.append(_number(item, v, float))
            else:
                parsed.append(_number(item, v, int))
        axes.append((key, parsed))
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def _number(item: str, v: str, kind: type) -> Any:
    try:
        x = kind(v)
    except ValueError:
        raise SimUsageError(f"--sweep {item!r}: {v!r} is not a number") from None
    if x <= 0:
        raise SimUsageError(f"--sweep {item!r}: {v!r} must be positive")
    return x


def _config(args: argparse.Namespace):
    from fleetserve.cluster.cli import config_from_args

    ratio = vars(args).get("pd_ratio")
    config = config_from_args(args)
    if ratio == "":  # a bare --pd: the pools' sizes from the config
        config = config.model_copy(update={"pd": config.pd.model_copy(update={"enabled": True})})
    elif ratio is not None:
        config = _with_pd(config, _pd_ratio(ratio))
    return config


def _with_pd(config, ratio: Optional[tuple[int, int]]):
    """`config` with P/D on at `ratio` (prefill, decode), or off for None."""
    if ratio is None:
        return config.model_copy(update={"pd": config.pd.model_copy(update={"enabled": False})})
    p, d = ratio
    pd = config.pd.model_copy(
        update={
            "enabled": True,
            "prefill": config.pd.prefill.model_copy(update={"num_replicas": p}),
            "decode": config.pd.decode.model_copy(update={"num_replicas": d}),
        }
    )
    return config.model_copy(update={"pd": pd})


def _trace(args: argparse.Namespace, rate_override: Optional[float] = None):
    from fleetserve.sim.generators import generate
    from fleetserve.sim.traces import read_trace

    a = vars(args)
    if a.get("trace") is not None:
        if rate_override is not None:
            raise SimUsageError("--sweep request_rate needs --generate (a trace file has its own arrivals)")
        return read_trace(a["trace"], a.get("trace_format"))
    kind = a.get("generate")
    if kind is None:
        raise SimUsageError("give a trace: --trace FILE, or --generate KIND (see --help)")
    n = int(a.get("num_requests", 1000))
    rate = float(rate_override if rate_override is not None else a.get("request_rate", 10.0))
    if n < 1 or rate <= 0:
        raise SimUsageError("--num-requests and --request-rate must be positive")
    try:
        return generate(
            kind, num_requests=n, rate=rate, seed=int(a.get("sim_seed", 0)), **_gen_options(kind, a.get("gen", []))
        )
    except TypeError as e:  # an option the generator does not take
        raise SimUsageError(f"--generate {kind}: {e}") from None


def simulate(config, requests, cost_model, args: argparse.Namespace, progress=None):
    """One simulation of `config` (an AppConfig) on `requests`."""
    from fleetserve.sim.cluster import run_simulation

    a = vars(args)
    # SLO-aware admission (--slo-ttft-ms, --slo-itl-ms, --slo-profile, tenants' `slo` in
    # --api-keys-file), as `fleetserve serve` runs it; its targets are goodput's unless
    # --slo-ttft-s / --slo-itl-s say otherwise.
    slo = config.slo_settings()
    kwargs: dict[str, Any] = {
        "seed": int(a.get("sim_seed", 0)),
        "slo_ttft_s": a.get("slo_ttft_s", slo.default.ttft_s if slo is not None else None),
        "slo_itl_s": a.get("slo_itl_s", slo.default.itl_s if slo is not None else None),
        "slo": slo,
        "stats_period_s": config.routing.stats_period_s,
        "policy_kwargs": {
            "imbalance_threshold": config.routing.imbalance_threshold,
            "min_match_fraction": config.routing.min_match_fraction,
            "max_table_entries": config.routing.max_table_entries,
        },
    }
    for key in ("network_latency_s", "kv_event_lag_s"):
        if a.get(key) is not None:
            kwargs[key] = float(a[key])
    num_replicas = config.num_replicas
    if config.pd.enabled:
        kwargs["pd"] = (config.pd.prefill.num_replicas, config.pd.decode.num_replicas)
        kwargs["pd_min_prefill_tokens"] = config.pd.min_prefill_tokens
        kwargs["kv_connector"] = config.pd.connector
        num_replicas = sum(kwargs["pd"])
    if progress is not None:
        kwargs["progress"] = progress
    return run_simulation(requests, cost_model, num_replicas, config.routing_policy, config.engine, **kwargs)


def _progress_bar(enabled: bool, total: int, desc: str):
    """(callback, close) for a tqdm bar over finished requests, or no-ops."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(done: int, n: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def _row(point: dict[str, Any], result: dict[str, Any], gpus_per_replica: int) -> dict[str, Any]:
    cfg = result["config"]
    replicas = int(cfg.get("num_replicas", len(result["replicas"])))
    return {
        **{k: (f"{v[0]}:{v[1]}" if k == "pd" else v) for k, v in point.items()},
        "replicas": replicas,
        "gpus": replicas * gpus_per_replica,
        "completed": result["completed"],
        "refused": result["refused"],
        "output_tokens_per_s": result["output_tokens_per_s"],
        "ttft_p50_s": result["ttft_s"]["p50"],
        "ttft_p90_s": result["ttft_s"]["p90"],
        "ttft_p99_s": result["ttft_s"]["p99"],
        "itl_p50_s": result["itl_s"]["p50"],
        "itl_p99_s": result["itl_s"]["p99"],
        "prefix_hit_rate": result["prefix_hit_rate"],
        "goodput": result.get("goodput"),
        "slo_attainment": result["slo"]["attainment"] if result.get("slo") else None,
    }


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = list(rows[0])
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*(_fmt(r[c]) for c in cols))
    Console(file=sys.stdout, width=max(120, 12 * len(cols))).print(table)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Goodput (or output tokens/s without an SLO) against GPUs, one labelled point per row,
    as DistServe plots goodput against cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "goodput" if rows[0].get("goodput") is not None else "output_tokens_per_s"
    label_keys = [k for k in rows[0] if k in SWEEP_KEYS]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series = ", ".join(f"{k}={r[k]}" for k in label_keys if k not in ("num_replicas", "pd", "request_rate"))
        groups.setdefault(series or metric, []).append(r)
    for series, rs in groups.items():
        rs = sorted(rs, key=lambda r: (r["gpus"], r.get("request_rate") or 0))
        xs = [r["gpus"] for r in rs]
        ys = [r[metric] for r in rs]
        ax.plot(xs, ys, marker="o", label=series)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(
                ", ".join(str(r[k]) for k in label_keys if k in ("pd", "request_rate")),
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    ax.set_xlabel("GPUs (replicas x tensor-parallel size)")
    ax.set_ylabel("goodput (requests/s meeting the SLO)" if metric == "goodput" else "output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _apply_point(config, point: dict[str, Any]):
    """`config` with one sweep point's values (validated as the schema validates them)."""
    from typing import get_args

    from fleetserve.cluster.config import RoutingPolicyName

    update: dict[str, Any] = {}
    if "num_replicas" in point:
        update["num_replicas"] = point["num_replicas"]
    if "routing_policy" in point:
        if point["routing_policy"] not in get_args(RoutingPolicyName):
            raise SimUsageError(
                f"--sweep routing_policy={point['routing_policy']}: not one of {', '.join(get_args(RoutingPolicyName))}"
            )
        update["routing_policy"] = point["routing_policy"]
    if "max_num_batched_tokens" in point:
        engine = config.engine.model_dump(exclude_unset=True)
        engine["max_num_batched_tokens"] = point["max_num_batched_tokens"]
        update["engine"] = type(config.engine).model_validate(engine)
    out = config.model_copy(update=update) if update else config
    if "pd" in point:
        out = _with_pd(out, point["pd"])
    return out


def cmd_sim(args: argparse.Namespace) -> int:
    from fleetserve.sim.profile import ProfileError, load_profile

    a = vars(args)
    try:
        config = _config(args)
        profile = load_profile(a.get("profile", "h100-llama-3.1-8b"))
        points = parse_sweep(a.get("sweep", [])) if a.get("sweep") else [{}]
        base_requests = None if any("request_rate" in p for p in points) else _trace(args)
        # Checked before any long run: every point's config must be valid.
        configs = [_apply_point(config, p) for p in points]
    except (ValidationError, ValueError, OSError) as e:  # TraceError, ProfileError, SimUsageError
        kind = "invalid configuration" if isinstance(e, ValidationError) else "error"
        print(f"fleetserve sim: {kind}:\n{e}" if kind != "error" else f"fleetserve sim: {e}", file=sys.stderr)
        return 2
    cost = profile.cost_model()
    gpus_per_replica = int(profile.tensor_parallel_size)
    output = Path(a.get("output", "sim_result.json"))
    results: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for point, cfg in zip(points, configs):
        try:
            requests = base_requests if base_requests is not None else _trace(args, point.get("request_rate"))
        except ValueError as e:  # TraceError, SimUsageError, an unknown generator
            print(f"fleetserve sim: {e}", file=sys.stderr)
            return 2
        desc = "sim " + (", ".join(f"{k}={v}" for k, v in point.items()) if point else profile.name)
        update, close = _progress_bar(not a.get("no_progress", False) and sys.stderr.isatty(), len(requests), desc)
        try:
            result = simulate(cfg, requests, cost, args, update)
        except (ValueError, ProfileError) as e:
            close()
            print(f"fleetserve sim: {desc}: {e}", file=sys.stderr)
            return 2
        close()
        d = result.to_dict()
        d["profile"] = {
            "name": profile.name,
            "kind": profile.kind,
            "hardware": profile.hardware,
            "model": profile.model,
        }
        d["wall_s"] = round(result.wall_s, 3)
        d["simulated_requests_per_wall_s"] = round(len(requests) / result.wall_s, 1) if result.wall_s else None
        if point:
            d["point"] = {k: (f"{v[0]}:{v[1]}" if k == "pd" else v) for k, v in point.items()}
        results.append(d)
        rows.append(_row(point, d, gpus_per_replica))
    title = f"fleetserve sim: {profile.name} ({profile.kind}), {len(requests)} requests"
    if len(results) == 1:
        _print_summary(results[0], title)
        payload: dict[str, Any] = results[0]
    else:
        print_table(rows, title)
        payload = {"sweep": a["sweep"], "rows": rows, "points": results}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {output}")
    if len(results) > 1:
        plot = Path(a.get("plot") or output.with_suffix(".png"))
        plot_sweep(rows, plot, title)
        print(f"wrote {plot}")
    return 0


def _print_summary(d: dict[str, Any], title: str) -> None:
    def pct(m: dict[str, float]) -> str:
        return " / ".join(_fmt(m[k]) for k in ("p50", "p90", "p99"))

    rows = [
        {"metric": "requests (completed / refused)", "value": f"{d['requests']} ({d['completed']} / {d['refused']})"},
        {"metric": "simulated duration s", "value": _fmt(d["duration_s"])},
        {"metric": "output tokens/s", "value": _fmt(d["output_tokens_per_s"])},
        {"metric": "TTFT s p50 / p90 / p99", "value": pct(d["ttft_s"])},
        {"metric": "ITL s p50 / p90 / p99", "value": pct(d["itl_s"])},
        {"metric": "E2E s p50 / p90 / p99", "value": pct(d["e2e_s"])},
        {"metric": "prefix hit rate", "value": _fmt(d["prefix_hit_rate"])},
        {"metric": "preemptions", "value": str(d["preemptions"])},
        {"metric": "KV bytes moved", "value": f"{d['kv_bytes_moved']:,}"},
        {"metric": "utilization (mean / max)", "value": _util(d["utilization"])},
    ]
    if d.get("goodput") is not None:
        rows.append({"metric": "goodput req/s (SLO met)", "value": _fmt(d["goodput"])})
    rows.append(
        {
            "metric": "wall s (simulated req per wall s)",
            "value": f"{d['wall_s']} ({d['simulated_requests_per_wall_s']})",
        }
    )
    print_table(rows, title)


def _util(u: list[float]) -> str:
    return f"{sum(u) / len(u):.3f} / {max(u):.3f}" if u else "-"
