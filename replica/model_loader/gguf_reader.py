"""A small, fast GGUF reader: metadata and raw tensor bytes, memory-mapped.

`gguf.GGUFReader` builds a numpy view per array element while parsing, which is
slow on a file with a large vocabulary (SmolLM2's: 49k strings and merges); this
reader walks the same header with `struct` (figures: docs/deployment/cpu.md,
"Figures behind the code") and validates that every tensor lies inside the
file, so a truncated or corrupt file fails with a ValueError naming it instead
of a numpy error deep inside dequantization. Dequantization itself uses the `gguf` package (`gguf.quants.dequantize`).

File layout (GGUF v2/v3, little endian):

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml_type, u64 offset)
    padding to `general.alignment` (32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/HF order (outermost first), e.g. [out_features, in_features]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; `raw(name)` gives a tensor's bytes as numpy (no copy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._pos = 0  # the parser's read offset
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: empty file cannot be mapped
            raise ValueError(f"cannot read GGUF file {self.path}: {e}") from e
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, OverflowError, ValueError, MemoryError) as e:
            raise ValueError(f"corrupt or truncated GGUF file {self.path}: {e}") from e

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._mm):
            raise ValueError("string runs past the end of the file")
        s = self._mm[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary: SmolLM2's tokens and merges are ~100k) in one tight
        loop: `_string` per item was a visible part of every engine start."""
        mm, pos, size = self._mm, self._pos, len(self._mm)
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(mm, pos)
            pos += 8
            if pos + n > size:
                raise ValueError("string runs past the end of the file")
            append(mm[pos : pos + n].decode("utf-8"))
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._read("<I"), self._read("<Q")
            if item_type == _STRING:
                return self._strings(count)
            if item_type == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NP_SCALARS[item_type])
            end = self._pos + count * dtype.itemsize
            if end > len(self._mm):
                raise ValueError("array runs past the end of the file")
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos).tolist()
            self._pos = end
            return [bool(x) for x in arr] if item_type == 7 else arr
        return self._read(_SCALARS[vtype])

    def _parse(self) -> None:
        self._pos = 0
        if self._mm[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            ggml_type = GGMLQuantizationType(self._read("<I"))
            infos.append((name, dims, ggml_type, self._read("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elements = int(np.prod(dims)) if dims else 1
            if dims[0] % block_size:
                raise ValueError(f"tensor {name!r}: row of {dims[0]} is not a multiple of the block size")
            nbytes = n_elements // block_size * type_size
            start = data_start + offset
            if start + nbytes > len(self._mm):
                raise ValueError(
                    f"tensor {name!r} ends at byte {start + nbytes} but the file has {len(self._mm)} bytes (truncated?)"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes (quantized types) or values, shaped for `gguf.quants.dequantize`."""
        info = self.tensors[name]
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1]
        return data.reshape(*rows, info.shape[-1] // block_size * type_size)

    def close(self) -> None:
        self._mm.close()
