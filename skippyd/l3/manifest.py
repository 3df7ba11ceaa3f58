"""The L3 manifest format and the names of L3 objects.

A manifest is one entry's description (:class:`~skippyd.payload.Entry`) plus how its data region is
checked: the segment size and a BLAKE3 digest per segment. On disk::

    "SKIPPYD-L3-MANIFEST 1\\n" + BLAKE3(hex) of the JSON + "\\n" + JSON

with the JSON keys format, key, identity, token_count, kind, digest, meta, tensors, data_len,
segment_bytes, segments, created_ns. An object (one data region, exactly as L2 lays it out) is named by
:func:`object_id`: its content digest *and* its layout, so the same bytes in another layout never share
an object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from skippyd.errors import CorruptEntry, InvalidArgument
from skippyd.keys import is_hex_digest
from skippyd.payload import Entry, TensorSpec

__all__ = ["MANIFEST_FORMAT", "SEGMENT_BYTES", "Manifest", "decode_manifest", "encode_manifest", "object_id"]

MANIFEST_FORMAT = 1
SEGMENT_BYTES = 4 << 20
MAX_MANIFEST = 8 << 20
_MAGIC = b"SKIPPYD-L3-MANIFEST 1\n"


def object_id(digest: str, tensors: tuple[TensorSpec, ...], data_len: int) -> str:
    """The name of the object holding a data region: BLAKE3 over the domain, the digest and the layout."""
    layout = json.dumps([[t.offset, t.nbytes] for t in tensors] + [data_len], separators=(",", ":"))
    return str(blake3(b"skippyd/l3-object/v1\x00" + digest.encode() + layout.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class Manifest:
    """One L3 entry: what it is, and the digests its object's segments must hash to."""

    entry: Entry
    segment_bytes: int
    segments: tuple[str, ...]
    object: str = field(init=False, repr=False, compare=False)  # derived once: lookups use it

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "object", object_id(self.entry.digest, self.entry.tensors, self.entry.data_len)
        )

    def to_json(self) -> dict[str, Any]:
        e = self.entry
        return {
            "format": MANIFEST_FORMAT,
            "key": e.key,
            "identity": e.identity,
            "token_count": e.token_count,
            "kind": e.kind,
            "digest": e.digest,
            "meta": dict(e.meta),
            "tensors": [spec.to_wire() for spec in e.tensors],
            "data_len": e.data_len,
            "segment_bytes": self.segment_bytes,
            "segments": list(self.segments),
            "created_ns": e.created_ns,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Manifest:
        try:
            if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
                raise CorruptEntry("unknown manifest format")
            meta = doc["meta"]
            if not isinstance(meta, dict):
                raise CorruptEntry("manifest meta is not a map")
            entry = Entry(
                key=doc["key"],
                identity=doc["identity"],
                token_count=int(doc["token_count"]),
                kind=doc["kind"],
                digest=doc["digest"],
                meta=meta,
                tensors=tuple(TensorSpec.from_wire(item) for item in doc["tensors"]),
                data_len=int(doc["data_len"]),
                created_ns=int(doc.get("created_ns", 0)),
                origin="l3",
            )  # fmt: skip  (Entry checks the names, the kind, the token count and the tensor table)
            manifest = cls(entry, int(doc["segment_bytes"]), tuple(doc["segments"]))
        except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
            raise CorruptEntry(f"manifest is invalid: {exc}") from exc
        if manifest.segment_bytes <= 0 or len(manifest.segments) != -(
            -entry.data_len // manifest.segment_bytes
        ):
            raise CorruptEntry("manifest segment list does not cover the data")
        if any(not is_hex_digest(s) for s in manifest.segments):
            raise CorruptEntry("manifest segment digests are malformed")
        return manifest


def encode_manifest(manifest: Manifest) -> bytes:
    body = json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return _MAGIC + blake3(body).hexdigest().encode() + b"\n" + body


def decode_manifest(raw: bytes) -> Manifest:
    if not raw.startswith(_MAGIC):
        raise CorruptEntry("not a skippyd manifest")
    checksum, _, body = raw[len(_MAGIC) :].partition(b"\n")
    if blake3(body).hexdigest().encode() != checksum:
        raise CorruptEntry("manifest checksum does not match")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptEntry(f"manifest is not JSON: {exc}") from exc
    return Manifest.from_json(doc)
