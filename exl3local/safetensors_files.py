"""A checkpoint's safetensors files read without their tensor data: the headers (one file, or every shard an
index lists) and single 4-byte reads. Every malformed byte is a CheckpointError naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# A real header is a few MiB at most; the cap stops a corrupt length from allocating gigabytes.
MAX_HEADER_BYTES = 256 * 1024 * 1024
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header declares it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header: 8-byte little-endian length, then a JSON object."""
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(name, None, "an 8-byte safetensors header length", f"{size} bytes")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    name, None, f"a header of at most {min(size - 8, MAX_HEADER_BYTES)} bytes",
                    f"a declared header length of {length} (truncated file?)",
                )
            raw = f.read(length)
    except OSError as err:
        raise CheckpointError(name, None, "a readable safetensors file", str(err)) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(name, None, "a JSON safetensors header", f"malformed JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(name, None, "a JSON object as header", type(header).__name__)
    data_start, data_size = 8 + length, size - 8 - length
    tensors = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        tensors[tensor] = _tensor_info(name, tensor, entry, data_start, data_size)
    return tensors


def _tensor_info(file: str, tensor: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(file, tensor, "a header entry object", type(entry).__name__)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(file, tensor, f"a dtype in {sorted(DTYPE_BYTES)}", repr(dtype))
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(file, tensor, "a shape of non-negative integers", repr(shape))
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise CheckpointError(file, tensor, f"data_offsets [begin, end] within {data_size} data bytes", repr(offsets))
    info = TensorInfo(tensor, dtype, tuple(shape), file, data_start + offsets[0])
    if offsets[1] - offsets[0] != info.nbytes:
        raise CheckpointError(
            file, tensor, f"{info.nbytes} bytes for {dtype}{list(shape)}", f"{offsets[1] - offsets[0]} bytes"
        )
    return info


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path.name, None, what, "no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(path.name, None, what, f"unreadable ({err})") from None


def read_tensors(root: Path) -> dict[str, TensorInfo]:
    """All tensors of the checkpoint, from the single file or from every shard of the index."""
    index_path = root / INDEX_FILE
    if not index_path.exists():
        if not (root / SINGLE_FILE).exists():
            raise CheckpointError(str(root), None, f"{SINGLE_FILE} or {INDEX_FILE}", "neither")
        return read_header(root / SINGLE_FILE)
    index = read_json(index_path, "a safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(INDEX_FILE, None, "a weight_map of tensor -> shard file", repr(type(weight_map)))
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = root / shard
        if Path(shard).name != shard or not shard_path.is_file():
            raise CheckpointError(INDEX_FILE, None, f"shard {shard!r} in the checkpoint", "missing")
        tensors.update(read_header(shard_path))
    for name, shard in weight_map.items():
        if name not in tensors or tensors[name].file != shard:
            raise CheckpointError(shard, name, "the tensor the index lists for this shard", "absent")
    return tensors


def read_marker(root: Path, info: TensorInfo) -> int:
    with (root / info.file).open("rb") as f:
        f.seek(info.offset)
        raw = f.read(4)
    if len(raw) != 4:
        raise CheckpointError(info.file, info.name, "4 bytes of marker data", f"{len(raw)} bytes (truncated)")
    return struct.unpack("<I", raw)[0]
