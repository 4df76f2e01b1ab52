"""cpu_bind values (taskset's list form), checked without importing torch: EngineArgs
validates them in the replica process, which never loads the model (worker.device binds)."""

from __future__ import annotations

from typing import Optional


def parse_cpu_list(spec: str) -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (taskset's list form)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_bind: {part!r} is not a core number or a range like 0-3 (in {spec!r})")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu_bind: range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def check_cpu_bind(spec: Optional[str]) -> Optional[str]:
    """Validate an EngineArgs.cpu_bind value (None, "auto", "nobind", "0-3,8" or per TP rank "0-1|2-3")."""
    if spec is None or spec in ("auto", "nobind"):
        return spec
    for rank_spec in spec.split("|"):
        parse_cpu_list(rank_spec)
    return spec
