"""The entry format: a self-describing header, a tensor table and an aligned data region.

An entry file (L2) or segment set (L3) holds named tensors as raw bytes. Nothing here imports torch:
dtypes are names with item sizes, and bfloat16/float8 are bytes like any other.

File layout (docs/format.md)::

    0      fixed header, 64 bytes:  magic "SKIPPYD\\0" | u16 format | u16 flags | u32 header_len
                                    | u64 data_offset | u64 data_len | 32-byte BLAKE3 of header
    64     header: canonical JSON (format, key, identity, token_count, kind, digest, meta, tensors, ...)
    data_offset (4 KiB aligned)     tensor bytes, each tensor at a 4 KiB aligned offset of the region

The payload ``digest`` is BLAKE3 over the tensors' bytes concatenated in table order (padding excluded),
so it names the content whatever the layout; it is always computed by the daemon over the bytes it
serves. The 32-byte header checksum covers the fixed fields and the JSON, so a flipped bit anywhere in
the metadata is caught too.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from blake3 import blake3

from .errors import CorruptEntry, InvalidArgument, UnsupportedDtype, describe
from .keys import is_hex_digest

__all__ = [
    "ALIGN",
    "DTYPES",
    "FIXED_HEADER_SIZE",
    "FORMAT_VERSION",
    "KINDS",
    "MAGIC",
    "Entry",
    "EntryRef",
    "TensorDecl",
    "TensorSpec",
    "align_up",
    "check_kind",
    "check_meta",
    "decode_fixed",
    "decode_header",
    "encode_header",
    "payload_digest",
    "plan_layout",
]

MAGIC = b"SKIPPYD\x00"
FORMAT_VERSION = 1
FIXED_HEADER_SIZE = 64
_FIXED = struct.Struct("<8sHHIQQ32s")
assert _FIXED.size == FIXED_HEADER_SIZE
ALIGN = 4096

KINDS = ("full-state", "kv", "kv-recurrent", "recurrent-only")

#: dtype name -> item size in bytes. Names are torch's, without the ``torch.`` prefix.
DTYPES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

MAX_TENSORS = 16384
MAX_NAME_BYTES = 256
MAX_DIMS = 16
MAX_DIM = 1 << 40
MAX_META_BYTES = 64 * 1024
#: How deep ``meta`` may nest (maps and lists together): deeper is refused before it is encoded.
MAX_META_DEPTH = 32
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_TOKEN_COUNT = 1 << 31


def align_up(value: int, align: int = ALIGN) -> int:
    return (value + align - 1) // align * align


@dataclass(frozen=True, slots=True)
class TensorDecl:
    """A tensor as a client declares it: name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor placed in an entry's data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, item: Any) -> TensorSpec:
        if not isinstance(item, list | tuple) or len(item) != 5:
            raise InvalidArgument("a tensor spec is [name, dtype, shape, offset, nbytes]")
        decl = check_decl(item[0], item[1], item[2])
        offset, nbytes = item[3], item[4]
        if not _is_uint(offset) or not _is_uint(nbytes) or nbytes != decl.nbytes:
            raise InvalidArgument(f"tensor {decl.name!r}: offset/nbytes do not match its shape")
        return cls(decl.name, decl.dtype, decl.shape, offset, nbytes)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_decl(name: Any, dtype: Any, shape: Any) -> TensorDecl:
    """Validates one declared tensor; every failure names the tensor."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgument(f"tensor names are non-empty strings of at most {MAX_NAME_BYTES} bytes")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UnsupportedDtype(f"tensor {describe(name)}: unsupported dtype {describe(dtype)}")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_DIMS:
        raise InvalidArgument(f"tensor {describe(name)}: shape must be a list of at most {MAX_DIMS} dims")
    dims = tuple(shape)
    if not all(_is_uint(d) and d < MAX_DIM for d in dims):
        raise InvalidArgument(f"tensor {describe(name)}: dims must be non-negative ints")
    return TensorDecl(name, dtype, dims)


def check_decls(decls: Iterable[TensorDecl]) -> list[TensorDecl]:
    out = list(decls)
    if len(out) > MAX_TENSORS:
        raise InvalidArgument(f"at most {MAX_TENSORS} tensors per entry")
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise InvalidArgument("tensor names must be unique within an entry")
    return out


def plan_layout(decls: Sequence[TensorDecl], align: int = ALIGN) -> tuple[list[TensorSpec], int]:
    """Places tensors at ``align``-aligned offsets in table order; returns the specs and the region length."""
    specs: list[TensorSpec] = []
    cursor = 0
    for decl in check_decls(decls):
        nbytes = decl.nbytes
        offset = align_up(cursor, align)
        specs.append(TensorSpec(decl.name, decl.dtype, decl.shape, offset, nbytes))
        cursor = offset + nbytes
    return specs, cursor


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}; got {describe(kind)}")
    return str(kind)


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` is a JSON-able dict of at most 64 KiB, nested at most 32 deep; returns a canonical copy."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise InvalidArgument(f"meta must be a dict, not {type(meta).__name__}")
    _check_depth(meta)
    try:
        text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"meta must be JSON-serialisable: {exc}") from exc
    if len(text) > MAX_META_BYTES:
        raise InvalidArgument(f"meta is larger than {MAX_META_BYTES} bytes once encoded")
    decoded: dict[str, Any] = json.loads(text)
    return decoded


def _check_depth(meta: Mapping[str, Any]) -> None:
    """Refuses ``meta`` nested deeper than :data:`MAX_META_DEPTH`, walked without recursion (a cycle is
    endless nesting), and more maps and lists than fit in :data:`MAX_META_BYTES` once encoded."""
    stack: list[tuple[Any, int]] = [(meta, 1)]
    containers = 0
    while stack:
        value, depth = stack.pop()
        if depth > MAX_META_DEPTH:
            raise InvalidArgument(f"meta nests deeper than {MAX_META_DEPTH} levels")
        containers += 1
        if containers > MAX_META_BYTES // 2:  # every map or list takes at least two bytes of JSON
            raise InvalidArgument(f"meta is larger than {MAX_META_BYTES} bytes once encoded")
        children = value.values() if isinstance(value, Mapping) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, Mapping | list | tuple))


def payload_digest(buffer: Any, tensors: Sequence[TensorSpec], *, base: int = 0, threads: int = 1) -> str:
    """BLAKE3 over each tensor's bytes in table order, read from ``buffer`` at ``base + offset``."""
    view = memoryview(buffer).cast("B")
    hasher = blake3(max_threads=threads)
    for spec in tensors:
        if spec.nbytes:
            start = base + spec.offset
            hasher.update(view[start : start + spec.nbytes])
    return str(hasher.hexdigest())


@dataclass(frozen=True, slots=True)
class Entry:
    """Everything an entry says about itself, in L2 and L3 alike; validated on encode and on decode.

    ``nbytes`` (the tensors' bytes, padding excluded) is derived once. ``meta`` is read-only.
    """

    key: str
    identity: str
    token_count: int
    kind: str
    digest: str
    meta: Mapping[str, Any]
    tensors: tuple[TensorSpec, ...]
    data_len: int
    created_ns: int = 0
    origin: str = "capture"
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_hex_digest(self.key) or not is_hex_digest(self.identity):
            raise InvalidArgument("key and identity must be hex BLAKE3 digests")
        if not is_hex_digest(self.digest):
            raise InvalidArgument("digest must be a hex BLAKE3 digest")
        if not _is_uint(self.token_count) or not 0 < self.token_count <= MAX_TOKEN_COUNT:
            raise InvalidArgument("token_count must be a positive int")
        check_kind(self.kind)
        end = 0
        for spec in self.tensors:
            if spec.offset < end:
                raise InvalidArgument(f"tensor {spec.name!r} overlaps the one before it")
            end = spec.offset + spec.nbytes
        if end > self.data_len:
            raise InvalidArgument("tensor table runs past the data region")
        if not isinstance(self.meta, MappingProxyType):
            object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))
        object.__setattr__(self, "nbytes", sum(spec.nbytes for spec in self.tensors))

    def ref(self) -> EntryRef:
        """What an index keeps of this entry (see :class:`EntryRef`)."""
        return EntryRef(
            key=self.key, identity=_intern(self.identity), token_count=self.token_count,
            kind=_intern(self.kind), digest=self.digest, data_len=self.data_len, nbytes=self.nbytes,
            tensor_count=len(self.tensors), created_ns=self.created_ns,
        )  # fmt: skip

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_VERSION,
            "key": self.key,
            "identity": self.identity,
            "token_count": self.token_count,
            "kind": self.kind,
            "digest": self.digest,
            "meta": dict(self.meta),
            "tensors": [spec.to_wire() for spec in self.tensors],
            "data_len": self.data_len,
            "created_ns": self.created_ns,
            "origin": self.origin,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> Entry:
        try:
            doc = json.loads(raw)
        except (
            UnicodeDecodeError,
            json.JSONDecodeError,
            RecursionError,
        ) as exc:  # (deep meta of old versions)
            raise CorruptEntry(f"entry header is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            raise CorruptEntry("entry header has an unknown format")
        try:
            tensors = tuple(TensorSpec.from_wire(item) for item in doc["tensors"])
            check_decls(TensorDecl(t.name, t.dtype, t.shape) for t in tensors)
            meta = doc["meta"]
            if not isinstance(meta, dict):
                raise InvalidArgument("meta is not a map")
            return cls(
                key=doc["key"],
                identity=doc["identity"],
                token_count=doc["token_count"],
                kind=doc["kind"],
                digest=doc["digest"],
                meta=meta,
                tensors=tensors,
                data_len=doc["data_len"],
                created_ns=doc.get("created_ns", 0),
                origin=doc.get("origin", "capture"),
            )
        except (KeyError, TypeError, InvalidArgument) as exc:
            raise CorruptEntry(f"entry header is invalid: {exc}") from exc


@dataclass(frozen=True, slots=True)
class EntryRef:
    """An entry as an index keeps it when the rest stays on disk: what lookups, listings and budgets
    need. ``Entry.ref()`` makes one; the tensor table and ``meta`` are read back when the entry is
    loaded, so an index of these costs the same per entry whatever the entry's ``meta`` holds."""

    key: str
    identity: str
    token_count: int
    kind: str
    digest: str
    data_len: int
    nbytes: int
    tensor_count: int
    created_ns: int


_interned: dict[str, str] = {}


def _intern(text: str) -> str:
    """One string object per identity digest or kind, however many entries share it."""
    return _interned.setdefault(text, text)


def encode_header(header: Entry) -> tuple[bytes, int]:
    """The bytes that precede the data region, and the data region's file offset."""
    body = header.to_json()
    if len(body) > MAX_HEADER_BYTES:
        raise InvalidArgument("entry header is too large (too many tensors or too much meta)")
    data_offset = align_up(FIXED_HEADER_SIZE + len(body))
    fixed_wo_digest = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(body), data_offset, header.data_len, b"")
    checksum = blake3(fixed_wo_digest[:32] + body).digest()
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(body), data_offset, header.data_len, checksum)
    return fixed + body, data_offset


def header_span(header: Entry) -> int:
    """File offset of the data region for this header (what :func:`encode_header` will return)."""
    return align_up(FIXED_HEADER_SIZE + len(header.to_json()))


@dataclass(frozen=True, slots=True)
class FixedHeader:
    header_len: int
    data_offset: int
    data_len: int
    checksum: bytes
    prefix: bytes


def decode_fixed(raw: bytes) -> FixedHeader:
    if len(raw) < FIXED_HEADER_SIZE:
        raise CorruptEntry("entry is shorter than its fixed header")
    magic, version, _flags, header_len, data_offset, data_len, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptEntry("bad magic: not a skippyd entry")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"entry format {version} is not {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or data_offset != align_up(FIXED_HEADER_SIZE + header_len):
        raise CorruptEntry("entry header length or data offset is inconsistent")
    return FixedHeader(header_len, data_offset, data_len, checksum, bytes(raw[:32]))


def decode_header(fixed: FixedHeader, body: bytes) -> Entry:
    """Checks the header checksum, then parses and validates the JSON."""
    if len(body) != fixed.header_len:
        raise CorruptEntry("entry header is truncated")
    if blake3(fixed.prefix + body).digest() != fixed.checksum:
        raise CorruptEntry("entry header checksum does not match")
    header = Entry.from_json(body)
    if header.data_len != fixed.data_len:
        raise CorruptEntry("entry header disagrees with its fixed fields")
    return header
