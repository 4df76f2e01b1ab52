"""Merge every replica's Prometheus text into one exposition, labelled by replica.

Each engine keeps its own registry (`AsyncEngine.metrics_text()`); the ingress
fetches all of them on demand when `/metrics` is scraped (pinned calls, see
router/routing/request_router.py) and relabels each sample with `replica="<id>"`.
Families with the same name are merged under one HELP/TYPE header, which keeps
the output valid for Prometheus and for `text_string_to_metric_families`.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def merge_metrics(texts: dict[str, str], label: str = "replica") -> str:
    """`texts`: replica id -> that replica's exposition text."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)
    for replica_id, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):  # prometheus_client's, which vLLM does not export
                continue
            kind, doc, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = dict(s.labels)
                labels[label] = replica_id
                lines.append(f"{s.name}{{{_labels(labels)}}} {_value(s.value)}")
    out = []
    for name, (kind, doc, lines) in families.items():
        if kind == "counter":  # the parser strips `_total`; the text format keeps it
            name += "_total"
        out.append(f"# HELP {name} {_escape_help(doc)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
    return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))
