"""Where an engine may load a LoRA adapter from at run time, and what a client hears when
it may not.

A path a client names (/v1/load_lora_adapter) is read on the replica's disk, so it is
checked there (`LoRAPathPolicy.resolve`) before any file is opened for the adapter:

- `--lora-modules` paths are the operator's: always allowed, as given.
- `--lora-roots DIR [DIR ...]`: the folder's real path (every symlink resolved) must lie
  under one of the roots (resolved the same way), and so must the real paths of its
  adapter_config.json and weights file, which must be regular files: a symlink inside a
  root that points out of it, or at a device or a FIFO, is refused.
- No roots: loading by path at run time is refused, unless `--allow-any-lora-path`
  (vLLM's behaviour: any folder the replica can read).

Every refusal (missing, outside the roots, unreadable, not a regular file, no adapter in
it) reaches the client as the same `LoRANotLoadable` ("... not found or cannot be
loaded", HTTP 404): the answer says nothing about which folders exist. The reason, with the
path, goes to the replica's log (`LoRAFileError`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Optional

# What every refused adapter path's error says (the engine core's answers carry it as text).
NOT_LOADABLE = "was not found or cannot be loaded"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRAFileError(ValueError):
    """An adapter folder that cannot be read as one (with the path and the reason): for the
    operator (the log, `fleetserve serve`'s checks of --lora-modules), never for a client."""


class LoRANotLoadable(ValueError):
    """What a client hears of an adapter path that may not or cannot be read."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The LoRA adapter '{name}' {NOT_LOADABLE}")
        self.name = name


def is_not_loadable(error_text: str) -> bool:
    """Whether an engine core's answer to a load is the generic refusal."""
    return NOT_LOADABLE in error_text


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class LoRAPathPolicy:
    """`roots`: real paths; `trusted`: the --lora-modules paths, as configured."""

    roots: tuple[str, ...] = ()
    allow_any: bool = False
    trusted: frozenset[str] = frozenset()

    @classmethod
    def from_args(cls, args) -> "LoRAPathPolicy":
        """From an EngineArgs' lora_roots, allow_any_lora_path and lora_modules."""
        roots = tuple(os.path.realpath(os.path.expanduser(r)) for r in getattr(args, "lora_roots", None) or ())
        return cls(
            roots,
            bool(getattr(args, "allow_any_lora_path", False)),
            frozenset(m.path for m in args.lora_modules or ()),
        )

    def resolve(self, path: str) -> str:
        """The adapter folder to read (its real path); LoRAFileError naming why not."""
        if path in self.trusted:
            return path
        if not self.roots and not self.allow_any:
            raise LoRAFileError(
                f"LoRA adapter {path!r}: loading adapters by path at run time is off "
                "(start the engine with --lora-roots DIR, or --allow-any-lora-path)"
            )
        real = os.path.realpath(path)
        root = self._root_of(real)
        if self.roots and root is None:
            raise LoRAFileError(f"LoRA adapter {path!r}: {real!r} is outside --lora-roots {list(self.roots)}")
        if not os.path.isdir(real):
            raise LoRAFileError(f"LoRA adapter {path!r}: no such folder")
        self._check_file(path, os.path.join(real, "adapter_config.json"), root, required=True)
        if not any(self._check_file(path, os.path.join(real, f), root) for f in WEIGHT_FILES):
            raise LoRAFileError(f"LoRA adapter {path!r}: no {' or '.join(WEIGHT_FILES)}")
        return real

    def _root_of(self, real: str) -> Optional[str]:
        return next((r for r in self.roots if _under(real, r)), None)

    def _check_file(self, path: str, file: str, root: Optional[str], required: bool = False) -> bool:
        """Whether `file` exists; LoRAFileError when it escapes the root or is no regular file."""
        real = os.path.realpath(file)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            if required:
                raise LoRAFileError(f"LoRA adapter {path!r}: no {os.path.basename(file)}") from None
            return False
        except OSError as e:
            raise LoRAFileError(f"LoRA adapter {path!r}: {file!r} cannot be read: {e.strerror}") from None
        if root is not None and not _under(real, root):
            raise LoRAFileError(f"LoRA adapter {path!r}: {file!r} leads out of its root to {real!r}")
        if not stat.S_ISREG(st.st_mode):
            raise LoRAFileError(f"LoRA adapter {path!r}: {file!r} is not a regular file")
        return True


__all__ = ["NOT_LOADABLE", "LoRAFileError", "LoRANotLoadable", "LoRAPathPolicy", "is_not_loadable"]
