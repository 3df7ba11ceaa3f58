"""The prefix index both tiers keep in memory: entries by cache key, in least-recently-used order.

A tier is searched three ways, and this one structure answers all three without a disk access:

* the captured token counts of an identity, up to a prompt's length (:meth:`PrefixIndex.lengths`):
  a restore hashes the prompt once and finalises one cache key per candidate length, longest first;
* the keys whose payload has a digest (:meth:`PrefixIndex.keys_of`): ``evict --digest``, and L3
  (the authority) vouching for an L2 entry;
* recency (:meth:`PrefixIndex.oldest`, :meth:`PrefixIndex.touch`): eviction takes the least recently
  used entry in O(1).

The values are the tier's own records; each names what the index needs through ``record.entry``
(key, identity, token count, digest). Not thread-safe: each tier calls it under its own lock.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["Indexed", "Lengths", "PrefixIndex", "Record"]


class Indexed(Protocol):
    """What the index reads of an entry."""

    @property
    def key(self) -> str: ...

    @property
    def identity(self) -> str: ...

    @property
    def token_count(self) -> int: ...

    @property
    def digest(self) -> str: ...


class Record(Protocol):
    @property
    def entry(self) -> Indexed: ...


R = TypeVar("R", bound=Record)


@dataclass(slots=True)
class Lengths:
    """Distinct captured prefix lengths of one identity, sorted, with how many entries have each."""

    sorted: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, n: int) -> None:
        if n in self.counts:
            self.counts[n] += 1
        else:
            self.counts[n] = 1
            bisect.insort(self.sorted, n)

    def discard(self, n: int) -> None:
        left = self.counts.get(n, 0) - 1
        if left > 0:
            self.counts[n] = left
        elif left == 0:
            del self.counts[n]
            self.sorted.pop(bisect.bisect_left(self.sorted, n))

    def upto(self, n: int) -> list[int]:
        return self.sorted[: bisect.bisect_right(self.sorted, n)]


class PrefixIndex(Generic[R]):
    """Records by cache key, least recently used first, with lengths per identity and keys per digest."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, R] = OrderedDict()
        self._lengths: dict[str, Lengths] = {}
        # digest -> its one key (the common case, kept as a plain string), or the set of them
        self._digests: dict[str, str | set[str]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[R]:
        """Least recently used first."""
        return iter(self._records.values())

    def get(self, key: str) -> R | None:
        return self._records.get(key)

    def add(self, record: R) -> R | None:
        """Indexes ``record`` as the most recently used; returns the record it replaced under its key."""
        entry = record.entry
        old = self.remove(entry.key)
        self._records[entry.key] = record
        self._lengths.setdefault(entry.identity, Lengths()).add(entry.token_count)
        keys = self._digests.get(entry.digest)
        if keys is None:
            self._digests[entry.digest] = entry.key
        elif isinstance(keys, str):
            self._digests[entry.digest] = {keys, entry.key}
        else:
            keys.add(entry.key)
        return old

    def insert_oldest(self, record: R) -> None:
        """Indexes ``record`` as the least recently used (rebuilding an index oldest-last at start)."""
        self.add(record)
        self._records.move_to_end(record.entry.key, last=False)

    def remove(self, key: str) -> R | None:
        record = self._records.pop(key, None)
        if record is None:
            return None
        entry = record.entry
        lengths = self._lengths.get(entry.identity)
        if lengths is not None:
            lengths.discard(entry.token_count)
            if not lengths.counts:
                del self._lengths[entry.identity]
        keys = self._digests.get(entry.digest)
        if isinstance(keys, str):
            if keys == key:
                del self._digests[entry.digest]
        elif keys is not None:
            keys.discard(key)
            if len(keys) == 1:
                self._digests[entry.digest] = next(iter(keys))
            elif not keys:
                del self._digests[entry.digest]
        return record

    def touch(self, key: str) -> R | None:
        """Marks the record under ``key`` as the most recently used."""
        record = self._records.get(key)
        if record is not None:
            self._records.move_to_end(key)
        return record

    def oldest(self) -> R | None:
        return next(iter(self._records.values()), None)

    def lengths(self, identity: str, upto: int) -> list[int]:
        """The distinct captured token counts of ``identity`` that are at most ``upto``, ascending."""
        lengths = self._lengths.get(identity)
        return lengths.upto(upto) if lengths is not None else []

    def keys_of(self, digest: str) -> list[str]:
        keys = self._digests.get(digest)
        if keys is None:
            return []
        return [keys] if isinstance(keys, str) else sorted(keys)

    def digests(self) -> list[str]:
        return list(self._digests)

    def clear(self) -> list[R]:
        """Forgets every record; returns them (least recently used first)."""
        records = list(self._records.values())
        self._records.clear()
        self._lengths.clear()
        self._digests.clear()
        return records
