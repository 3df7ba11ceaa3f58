"""Any sequence of admit/get/peek/remove/restart under a small budget matches a simple LRU model."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
from blake3 import blake3
from daemonutil import TEST_SHM
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from l2util import admit_bytes, get, key_of, keys_lru_first, size_of

from skippyd.errors import DigestMismatch, TooLarge
from skippyd.l2 import L2Tier
from skippyd.payload import header_span
from skippyd.shm import size_class

NAMES = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
SIZES = [100, 3000, 9000, 20000, 45000, 70000]
BUDGET = 5 * size_of(20000)
COUNTERS = ("hits", "misses", "inserts", "evictions", "admission_rejects", "refused_bytes")


class L2Machine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="skippyd-sm-", dir=TEST_SHM))
        self.tier = L2Tier.open(self.dir, BUDGET)
        self.order: OrderedDict[str, tuple[int, str]] = OrderedDict()  # key -> (file size, digest)
        self.counters = dict.fromkeys(COUNTERS, 0)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        name=st.sampled_from(NAMES),
        nbytes=st.sampled_from(SIZES),
        fill=st.integers(0, 255),
        corrupt=st.booleans(),
    )
    def admit(self, name: str, nbytes: int, fill: int, corrupt: bool) -> None:
        key, size = key_of(name), size_of(nbytes, name)
        digest = blake3(bytes([fill]) * nbytes).hexdigest()
        expected = blake3(b"not these bytes").hexdigest() if corrupt else digest
        if size > BUDGET:
            self.counters["refused_bytes"] += size
            with pytest.raises(TooLarge):
                admit_bytes(self.tier, name, nbytes, fill, expected=expected)
            return
        self.order.pop(key, None)
        while sum(s for s, _ in self.order.values()) + size > BUDGET:
            self.order.popitem(last=False)
            self.counters["evictions"] += 1
        if corrupt:
            self.counters["admission_rejects"] += 1
            with pytest.raises(DigestMismatch):
                admit_bytes(self.tier, name, nbytes, fill, expected=expected)
            return
        entry = admit_bytes(self.tier, name, nbytes, fill, expected=expected)
        assert size_class(header_span(entry) + entry.data_len) == size and entry.digest == digest
        self.order[key] = (size, digest)
        self.counters["inserts"] += 1

    @rule(name=st.sampled_from(NAMES))
    def get(self, name: str) -> None:
        key = key_of(name)
        entry = get(self.tier, key)
        if key in self.order:
            assert entry is not None and entry.digest == self.order[key][1]
            self.order.move_to_end(key)
            self.counters["hits"] += 1
        else:
            assert entry is None
            self.counters["misses"] += 1

    @rule(name=st.sampled_from(NAMES))
    def peek(self, name: str) -> None:
        key = key_of(name)
        entry = self.tier.peek(key)
        assert (entry is not None) == (key in self.order)

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name: str) -> None:
        key = key_of(name)
        assert self.tier.remove(key) == (key in self.order)
        self.order.pop(key, None)

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = L2Tier.open(self.dir, BUDGET)
        self.counters = dict.fromkeys(COUNTERS, 0)
        assert self.tier.stats().adopted == len(self.order)

    @invariant()
    def matches_the_model(self) -> None:
        stats = self.tier.stats()
        assert keys_lru_first(self.tier) == list(self.order)
        assert stats.bytes == sum(s for s, _ in self.order.values())
        assert stats.payload_bytes == sum(item.entry.nbytes for item in self.tier.entries())
        assert stats.bytes + stats.free_bytes + stats.reserved_bytes <= BUDGET
        assert stats.reserved_bytes == 0
        for name in COUNTERS:
            assert getattr(stats, name) == self.counters[name], name


TestL2Machine = L2Machine.TestCase
TestL2Machine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
