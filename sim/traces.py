"""Traces: the requests a simulation replays, and readers for the formats users have.

A trace is a list of `TraceRequest`s sorted by arrival, the first arriving at 0. Our own
format is JSONL, one request per line with the field names of `TraceRequest`. The
readers also take the public formats: Mooncake JSONL (`timestamp` in ms, `input_length`,
`output_length`, `hash_ids`), the Azure LLM inference trace CSV (`TIMESTAMP`,
`ContextTokens`, `GeneratedTokens`) and BurstGPT CSV (`Timestamp`, `Model`,
`Request tokens`, `Response tokens`, `Total tokens`, `Log Type`). Bad input raises
`TraceError` naming the file, the line and the field, so a user can fix the trace.

Rows of the foreign formats that generated no tokens are skipped: BurstGPT records failed
requests with 0 response tokens, and a request that produced nothing is not load a
replay can reproduce. Our own format rejects them (a generator never writes one).

`python -m fleetserve.sim.traces regenerate` rebuilds the shipped samples in `samples/`.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

BLOCK_TOKENS = 512  # Mooncake's block: one hash id per 512 prompt tokens
DEFAULT_VOCAB_SIZE = 32000
FORMATS = ("jsonl", "mooncake", "azure", "burstgpt")
SAMPLES_DIR = Path(__file__).resolve().parent / "samples"

_FIELDS = (
    "arrival_s",
    "prompt_tokens",
    "prompt_token_ids",
    "hash_ids",
    "block_tokens",
    "output_tokens",
    "tenant",
    "session",
    "priority",
    "request_id",
    "max_tokens",
)


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, line and field."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _id_list(name: str, v: object) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError(f"{name} must be a non-empty list of non-negative integers, got {v!r}")
    for x in v:
        if not _is_int(x) or x < 0:
            raise ValueError(f"{name} must be a non-empty list of non-negative integers, got element {x!r}")
    return tuple(v)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    The prompt is a count (`prompt_tokens`), explicit token ids (`prompt_token_ids`), or
    Mooncake-style `hash_ids`: one id per block of `block_tokens` tokens, equal ids
    meaning identical blocks that share the whole prefix before them. With `hash_ids`,
    `prompt_tokens` may also be given when the last block is partial; it defaults to
    `len(hash_ids) * block_tokens`.
    """

    arrival_s: float
    output_tokens: int
    prompt_tokens: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = BLOCK_TOKENS
    tenant: str | None = None
    session: str | None = None
    priority: int | None = None
    request_id: str | None = None
    # The client's max_tokens, when it differs from the output length (a request that ends
    # by itself, at EOS, after `output_tokens`): what an output-length predictor sees. Unset:
    # the request asks for exactly `output_tokens` (and runs with ignore_eos in the simulator).
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        a = self.arrival_s
        if isinstance(a, bool) or not isinstance(a, (int, float)) or a != a or a in (float("inf"), float("-inf")):
            raise ValueError(f"arrival_s must be a finite number of seconds, got {a!r}")
        object.__setattr__(self, "arrival_s", float(a))
        if not _is_int(self.output_tokens) or self.output_tokens < 1:
            raise ValueError(f"output_tokens must be a positive integer, got {self.output_tokens!r}")
        if not _is_int(self.block_tokens) or self.block_tokens < 1:
            raise ValueError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if self.prompt_tokens is not None and (not _is_int(self.prompt_tokens) or self.prompt_tokens < 1):
            raise ValueError(f"prompt_tokens must be a positive integer, got {self.prompt_tokens!r}")
        if self.prompt_token_ids is not None:
            ids = _id_list("prompt_token_ids", self.prompt_token_ids)
            object.__setattr__(self, "prompt_token_ids", ids)
            if self.hash_ids is not None:
                raise ValueError("prompt_token_ids: give exactly one of prompt_tokens, prompt_token_ids, hash_ids")
            if self.prompt_tokens is not None and self.prompt_tokens != len(ids):
                raise ValueError(
                    f"prompt_tokens must equal len(prompt_token_ids) = {len(ids)} when both are given,"
                    f" got {self.prompt_tokens}"
                )
        elif self.hash_ids is not None:
            hids = _id_list("hash_ids", self.hash_ids)
            object.__setattr__(self, "hash_ids", hids)
            b = self.block_tokens
            if self.prompt_tokens is not None and not (len(hids) - 1) * b < self.prompt_tokens <= len(hids) * b:
                raise ValueError(
                    f"prompt_tokens must lie in ({(len(hids) - 1) * b}, {len(hids) * b}] for {len(hids)} hash_ids"
                    f" of {b} tokens, got {self.prompt_tokens}"
                )
        elif self.prompt_tokens is None:
            raise ValueError("prompt_tokens: one of prompt_tokens, prompt_token_ids, hash_ids is required")
        for name in ("tenant", "session", "request_id"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string, got {v!r}")
        if self.priority is not None and not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < self.output_tokens):
            raise ValueError(
                f"max_tokens must be an integer >= output_tokens ({self.output_tokens}), got {self.max_tokens!r}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens, whichever way it is given."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        assert self.hash_ids is not None
        return len(self.hash_ids) * self.block_tokens

    def token_ids(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
        """The prompt as token ids, deterministic for the simulator.

        Each hash id's block is drawn from a generator seeded by that id (and cached), so
        requests with equal leading hash ids share exactly those blocks. A plain count
        draws from a generator seeded by the request's own fields, sharing nothing.
        """
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        n = self.num_prompt_tokens
        if self.hash_ids is None:
            seed = f"req:{self.request_id}:{self.arrival_s!r}:{n}:{self.tenant}:{self.session}:{self.output_tokens}"
            return _draw(seed, n, vocab_size).tolist()
        out: list[int] = []
        for h in self.hash_ids:
            out.extend(_block_ids(h, self.block_tokens, vocab_size))
        del out[n:]
        return out

    def to_dict(self) -> dict[str, Any]:
        """Our JSONL record: unset fields left out, `block_tokens` only where it matters."""
        d: dict[str, Any] = {"arrival_s": self.arrival_s}
        if self.prompt_tokens is not None:
            d["prompt_tokens"] = self.prompt_tokens
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.hash_ids is not None:
            d["hash_ids"] = list(self.hash_ids)
            if self.block_tokens != BLOCK_TOKENS:
                d["block_tokens"] = self.block_tokens
        d["output_tokens"] = self.output_tokens
        for name in ("tenant", "session", "priority", "request_id", "max_tokens"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        return d


@lru_cache(maxsize=8192)
def _block_ids(hash_id: int, block_tokens: int, vocab_size: int) -> array[int]:
    return array("i", _draw(f"block:{hash_id}", block_tokens, vocab_size).astype("int32").tobytes())


def _draw(seed: str, n: int, vocab_size: int):
    """`n` token ids drawn uniformly from [0, vocab_size) by a generator seeded with `seed`
    (the same on every machine and run; numpy's, which draws a 100k-token prompt in a
    millisecond where random.choices took tens)."""
    import numpy as np

    key = int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(key)).integers(0, vocab_size, n, dtype=np.int64)


def normalize(requests: Iterable[TraceRequest]) -> list[TraceRequest]:
    """Sorted by arrival (stable), shifted so the first request arrives at 0."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    if not reqs or reqs[0].arrival_s == 0.0:
        return reqs
    t0 = reqs[0].arrival_s
    return [_replace_arrival(r, r.arrival_s - t0) for r in reqs]


def _replace_arrival(r: TraceRequest, t: float) -> TraceRequest:
    d = {name: getattr(r, name) for name in _FIELDS}
    d["arrival_s"] = t
    return TraceRequest(**d)


# ---------------------------------------------------------------------------------------
# Reading


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its extension and first line or header."""
    p = Path(path)
    suffixes = [s for s in p.suffixes if s != ".gz"]
    ext = suffixes[-1].lower() if suffixes else ""
    try:
        with _open_text(p) as f:
            first = ""
            for line in f:
                if line.strip():
                    first = line.strip()
                    break
    except OSError as e:
        raise TraceError(f"{p.name}: cannot read: {e}") from e
    if not first:
        raise TraceError(f"{p.name}: empty trace")
    if ext in (".csv", ".tsv") or not first.startswith("{"):
        header = {h.strip() for h in next(csv.reader([first]))}
        if "ContextTokens" in header:
            return "azure"
        if "Request tokens" in header:
            return "burstgpt"
        raise TraceError(
            f"{p.name} line 1: unknown CSV header {sorted(header)}; expected Azure (TIMESTAMP, ContextTokens,"
            " GeneratedTokens) or BurstGPT (Timestamp, Model, Request tokens, Response tokens, ...)"
        )
    try:
        obj = json.loads(first)
    except json.JSONDecodeError as e:
        raise TraceError(f"{p.name} line 1: not JSON: {e.msg}") from e
    if isinstance(obj, dict) and "arrival_s" in obj:
        return "jsonl"
    if isinstance(obj, dict) and "timestamp" in obj and "input_length" in obj:
        return "mooncake"
    raise TraceError(
        f"{p.name} line 1: unknown JSONL record; expected our fields (arrival_s, ...) or Mooncake's"
        " (timestamp, input_length, output_length, hash_ids)"
    )


def read_trace(path: str | Path, format: str | None = None) -> list[TraceRequest]:
    """The requests of a trace file, normalised (sorted, first arrival at 0).

    `format` forces a reader (one of `FORMATS`); by default it is detected. Requests
    without a `request_id` get their line number as one, so every request is distinct.
    """
    p = Path(path)
    fmt = format or detect_format(p)
    readers = {"jsonl": _read_ours, "mooncake": _read_mooncake, "azure": _read_azure, "burstgpt": _read_burstgpt}
    if fmt not in readers:
        raise TraceError(f"{p.name}: unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        with _open_text(p) as f:
            reqs = readers[fmt](p.name, f)
    except OSError as e:
        raise TraceError(f"{p.name}: cannot read: {e}") from e
    if not reqs:
        raise TraceError(f"{p.name}: no requests in the trace")
    return normalize(reqs)


def _jsonl_records(name: str, f: IO[str]) -> Iterable[tuple[int, dict[str, Any]]]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{name} line {lineno}: not JSON: {e.msg}") from e
        if not isinstance(obj, dict):
            raise TraceError(f"{name} line {lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def _make(name: str, lineno: int, **kw: Any) -> TraceRequest:
    try:
        return TraceRequest(**kw)
    except ValueError as e:
        raise TraceError(f"{name} line {lineno}: {e}") from None


def _read_ours(name: str, f: IO[str]) -> list[TraceRequest]:
    out = []
    for lineno, obj in _jsonl_records(name, f):
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise TraceError(f"{name} line {lineno}: {unknown[0]} is not a trace field (known: {', '.join(_FIELDS)})")
        for req in ("arrival_s", "output_tokens"):
            if req not in obj:
                raise TraceError(f"{name} line {lineno}: {req} is missing")
        obj.setdefault("request_id", str(lineno))
        out.append(_make(name, lineno, **obj))
    return out


def _read_mooncake(name: str, f: IO[str]) -> list[TraceRequest]:
    out = []
    for lineno, obj in _jsonl_records(name, f):
        for req in ("timestamp", "input_length", "output_length"):
            if req not in obj:
                raise TraceError(f"{name} line {lineno}: {req} is missing")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise TraceError(f"{name} line {lineno}: timestamp must be a number of milliseconds, got {ts!r}")
        if _is_int(obj["output_length"]) and obj["output_length"] == 0:
            continue
        n_in = obj["input_length"]
        if not _is_int(n_in) or n_in < 1:
            raise TraceError(f"{name} line {lineno}: input_length must be a positive integer, got {n_in!r}")
        try:
            out_tokens = obj["output_length"]
            if not _is_int(out_tokens) or out_tokens < 1:
                raise ValueError(f"output_length must be a positive integer, got {out_tokens!r}")
            hids = obj.get("hash_ids")
            if hids is not None:
                hids = _id_list("hash_ids", hids)
        except ValueError as e:
            raise TraceError(f"{name} line {lineno}: {e}") from None
        out.append(
            _make(
                name,
                lineno,
                arrival_s=ts / 1000.0,
                prompt_tokens=n_in,
                hash_ids=hids,
                output_tokens=out_tokens,
                request_id=str(lineno),
            )
        )
    return out


def _csv_rows(name: str, f: IO[str], needed: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    reader = csv.reader(f)
    header = None
    for row in reader:
        if any(c.strip() for c in row):
            header = [c.strip() for c in row]
            break
    if header is None:
        return
    missing = [c for c in needed if c not in header]
    if missing:
        raise TraceError(f"{name} line {reader.line_num}: column {missing[0]} is missing from the header")
    for row in reader:
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{name} line {reader.line_num}: expected {len(header)} columns, got {len(row)}")
        yield reader.line_num, dict(zip(header, (c.strip() for c in row)))


def _csv_int(name: str, lineno: int, field: str, v: str, minimum: int) -> int:
    try:
        x = float(v)
        if x != int(x):
            raise ValueError
        n = int(x)
    except (ValueError, OverflowError):
        raise TraceError(f"{name} line {lineno}: {field} must be an integer, got {v!r}") from None
    if n < minimum:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise TraceError(f"{name} line {lineno}: {field} must be {what} integer, got {n}")
    return n


def _parse_time(name: str, lineno: int, field: str, v: str) -> float:
    """Seconds, from a number or an Azure datetime (`2023-11-16 18:15:46.6805900`)."""
    try:
        return float(v)
    except ValueError:
        pass
    s = v
    if "." in s:  # fromisoformat takes at most 6 fractional digits on some inputs
        head, _, frac = s.partition(".")
        digits = "".join(c for c in frac if c.isdigit())
        rest = frac[len(digits) :]
        s = f"{head}.{(digits + '000000')[:6]}{rest}"
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise TraceError(
            f"{name} line {lineno}: {field} must be seconds or a datetime like 2023-11-16 18:15:46.6805900, got {v!r}"
        ) from None


def _read_azure(name: str, f: IO[str]) -> list[TraceRequest]:
    out = []
    for lineno, row in _csv_rows(name, f, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        t = _parse_time(name, lineno, "TIMESTAMP", row["TIMESTAMP"])
        n_in = _csv_int(name, lineno, "ContextTokens", row["ContextTokens"], 1)
        n_out = _csv_int(name, lineno, "GeneratedTokens", row["GeneratedTokens"], 0)
        if n_out == 0:
            continue
        out.append(_make(name, lineno, arrival_s=t, prompt_tokens=n_in, output_tokens=n_out, request_id=str(lineno)))
    return out


_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def _read_burstgpt(name: str, f: IO[str]) -> list[TraceRequest]:
    """BurstGPT rows; the model name becomes the tenant. Failed rows (0 response tokens) are skipped."""
    out = []
    for lineno, row in _csv_rows(name, f, ("Timestamp", "Request tokens", "Response tokens")):
        t = _parse_time(name, lineno, "Timestamp", row["Timestamp"])
        n_in = _csv_int(name, lineno, "Request tokens", row["Request tokens"], 0)
        n_out = _csv_int(name, lineno, "Response tokens", row["Response tokens"], 0)
        if n_out == 0 or n_in == 0:
            continue
        model = row.get("Model") or None
        out.append(
            _make(
                name, lineno, arrival_s=t, prompt_tokens=n_in, output_tokens=n_out, tenant=model, request_id=str(lineno)
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Writing


def format_trace(requests: Iterable[TraceRequest], format: str = "jsonl") -> str:
    """The text of a trace file in one of `FORMATS` (the foreign ones keep only their columns)."""
    reqs = list(requests)
    if format == "jsonl":
        return "".join(json.dumps(r.to_dict(), separators=(",", ":")) + "\n" for r in reqs)
    if format == "mooncake":
        lines = []
        for r in reqs:
            d: dict[str, Any] = {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.num_prompt_tokens,
                "output_length": r.output_tokens,
            }
            if r.hash_ids is not None:
                d["hash_ids"] = list(r.hash_ids)
            lines.append(json.dumps(d) + "\n")
        return "".join(lines)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if format == "azure":
        base = datetime(2023, 11, 16, 18, 0, 0).timestamp()
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for r in reqs:
            stamp = datetime.fromtimestamp(base + r.arrival_s).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
            w.writerow([stamp, r.num_prompt_tokens, r.output_tokens])
        return buf.getvalue()
    if format == "burstgpt":
        w.writerow(list(_BURSTGPT_COLUMNS))
        for r in reqs:
            n_in = r.num_prompt_tokens
            log_type = "Conversation log" if r.session is not None else "API log"
            w.writerow(
                [f"{r.arrival_s:.0f}", r.tenant or "ChatGPT", n_in, r.output_tokens, n_in + r.output_tokens, log_type]
            )
        return buf.getvalue()
    raise ValueError(f"unknown trace format {format!r}; expected one of {', '.join(FORMATS)}")


def write_trace(path: str | Path, requests: Iterable[TraceRequest], format: str = "jsonl") -> None:
    """Write a trace file (our JSONL unless `format` names another)."""
    Path(path).write_text(format_trace(requests, format), encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Shipped samples


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fleetserve.sim.traces regenerate [DIR]`: rebuild the shipped samples."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "regenerate":
        print("usage: python -m fleetserve.sim.traces regenerate [DIR]", file=sys.stderr)
        return 2
    from fleetserve.sim.generators import sample_traces

    out = Path(args[1]) if len(args) > 1 else SAMPLES_DIR
    out.mkdir(parents=True, exist_ok=True)
    for fname, text in sample_traces().items():
        (out / fname).write_text(text, encoding="utf-8")
        print(f"wrote {out / fname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
