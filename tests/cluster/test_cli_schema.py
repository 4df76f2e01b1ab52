"""Flags are generated from the config schema: a field added to it gets a flag, its help,
its default and its choices with no change to the CLI."""

from __future__ import annotations

import argparse
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field

from fleetserve.cluster.cli_engine import add_schema_flags, nested_overrides


class Inner(BaseModel):
    depth: int = Field(3, description="How deep it goes.")


class Schema(BaseModel):
    mode: Literal["a", "b"] = Field("a", description="Which mode to run.")
    on: bool = Field(True, description="Whether it is on.")
    limit: Optional[int] = Field(None, description="The most there may be.")
    extra_config: Optional[dict] = Field(None, description="A JSON mapping of more settings.")
    inner: Inner = Inner()


def parser() -> tuple[argparse.ArgumentParser, list[str]]:
    p = argparse.ArgumentParser()
    return p, add_schema_flags(p, Schema)


def test_every_field_becomes_a_typed_flag_with_help_default_and_choices():
    p, dests = parser()
    assert dests == ["mode", "on", "limit", "extra_config", "inner.depth"]
    help_text = p.format_help()
    for text in (
        "--mode {a,b}",
        "Which mode to run. [default: a]",
        "--on, --no-on",
        "[default: unset]",
        "--extra-config JSON",
        "--inner-depth DEPTH",
        "How deep it goes. [default: 3]",
    ):
        assert text in " ".join(help_text.split()), text
    args = p.parse_args(
        ["--mode", "b", "--no-on", "--limit", "4", "--extra-config", '{"kv_role": "kv_both"}', "--inner-depth", "5"]
    )
    assert nested_overrides(args, dests) == {
        "mode": "b",
        "on": False,
        "limit": 4,
        "extra_config": {"kv_role": "kv_both"},
        "inner": {"depth": 5},
    }
    assert Schema.model_validate(nested_overrides(args, dests)).inner.depth == 5


def test_flags_not_given_stay_unset_and_bad_values_are_refused():
    p, dests = parser()
    assert nested_overrides(p.parse_args([]), dests) == {}
    for bad in (["--mode", "c"], ["--limit", "x"], ["--extra-config", "{not json"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
