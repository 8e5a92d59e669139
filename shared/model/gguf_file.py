"""A lazy GGUF reader: metadata and tensor index from the header, tensor bytes from a memory map.

`gguf.GGUFReader` builds a numpy view per element of every metadata array; for a 49k-token
vocabulary that takes seconds, and the gateway reads the header on every start. This reader parses
the header with `struct` and bulk numpy reads (~0.1 s), and leaves tensor data on disk until asked.
The quantization formats and their dequantization are the `gguf` package's own
(`gguf.GGMLQuantizationType`, `gguf.GGML_QUANT_SIZES`, `gguf.quants.dequantize`).

No torch: the gateway and `model_identity` use this module.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("reading a GGUF model needs the `gguf` package: pip install gguf") from e

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value type -> (struct code, numpy dtype) for the fixed-size scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"),
    5: ("i", "<i4"), 6: ("f", "<f4"), 7: ("?", "?"), 10: ("Q", "<u8"), 11: ("q", "<i8"),
    12: ("d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    """numpy order (rows first): the reverse of ggml's ne[] order."""
    qtype: GGMLQuantizationType
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int


class GGUFFile:
    """Header of one GGUF file plus lazy access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(self.path)!r} does not exist")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._parse()

    # -- header parsing ------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._mm
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"{str(self.path)!r} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{str(self.path)!r}: GGUF version {version} is not supported (need 2 or 3)")
        self.version = version
        pos = 24
        for _ in range(n_kv):
            key, pos = self._read_string(pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.metadata[key], pos = self._read_value(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._read_string(pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + align - 1) // align * align
        self.header_bytes = pos
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape))
            if n % block:
                raise ValueError(f"{str(self.path)!r}: tensor {name} has {n} elements, not a multiple "
                                 f"of the {qtype.name} block of {block}")
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset,
                                                n // block * type_size)

    def _read_string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, pos)
        pos += 8
        return bytes(self._mm[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

    def _read_value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._read_string(pos)
        if vtype in _SCALARS:
            code = _SCALARS[vtype][0]
            (v,) = struct.unpack_from("<" + code, self._mm, pos)
            return v, pos + struct.calcsize(code)
        if vtype == _ARRAY:
            itype, n = struct.unpack_from("<IQ", self._mm, pos)
            pos += 12
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype][1])
                arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=pos).copy()
                return arr, pos + n * dt.itemsize
            items = []
            for _ in range(n):  # strings or nested arrays: variable size, one at a time
                v, pos = self._read_value(itype, pos)
                items.append(v)
            return items, pos
        raise ValueError(f"{str(self.path)!r}: unknown GGUF value type {vtype}")

    # -- access --------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"GGUF file {str(self.path)!r} lacks metadata key {key!r}")
        return self.metadata[key]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor: uint8 [rows..., bytes_per_row] (a view of the map)."""
        info = self.tensors[name]
        data = self._mm[info.offset:info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 numpy array in numpy order, e.g. a linear weight as [out_features, in_features]."""
        if name not in self.tensors:
            raise ValueError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        info = self.tensors[name]
        out = dequantize(self.raw(name), info.qtype)  # F32 comes back as a read-only view of the map
        return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)

    def header_digest(self) -> str:
        """SHA-256 over the metadata and tensor index bytes (not the tensor data): cheap and stable."""
        return hashlib.sha256(memoryview(self._mm[:self.header_bytes])).hexdigest()
