"""The rules across tiers, in-process: the newest capture of a key wins over durable writes in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skippyd.keys import Identity, cache_key, encode_tokens
from skippyd.l2 import L2Tier
from skippyd.l3 import L3Store
from skippyd.payload import TensorDecl, plan_layout
from skippyd.tiers import Tiers

IDENT = Identity("m", "s")


def staged(fill: int, n: int = 10000) -> tuple[list[TensorDecl], memoryview]:
    decls = [TensorDecl("x", "uint8", (n,))]
    specs, length = plan_layout(decls)
    buf = bytearray(length)
    buf[specs[0].offset : specs[0].offset + n] = bytes([fill]) * n
    return decls, memoryview(buf)


@pytest.fixture
def tiers(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Tiers, threading.Event]]:
    gate = threading.Event()
    real = L3Store.write

    def gated(self: L3Store, entry: Any, data: memoryview) -> bool:
        gate.wait(timeout=30)
        return real(self, entry, data)

    monkeypatch.setattr(L3Store, "write", gated)
    t = Tiers(L2Tier(shm_dir, 64 << 20), l3=L3Store(tmp_path / "l3", 1 << 30))
    try:
        yield t, gate
    finally:
        gate.set()
        t.close()


def capture(t: Tiers, tokens: list[int], fill: int, durable: bool) -> str:
    decls, source = staged(fill)
    out = t.capture(
        identity=IDENT, tokens=encode_tokens(tokens), tensors=decls, source=source, durable=durable
    )
    return out.digest


def served_digest(t: Tiers, tokens: list[int]) -> str | None:
    import os

    opened = t.open_restore(IDENT, encode_tokens(tokens))
    if opened is None:
        return None
    os.close(opened.fd)
    return opened.digest


def test_a_queued_durable_write_superseded_by_a_newer_capture_never_reaches_l3(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    t, gate = tiers
    capture(t, [9, 9], fill=1, durable=True)  # occupies the writer until the gate opens
    capture(t, [1, 2, 3], fill=2, durable=True)  # v1 of the key, queued
    newest = capture(t, [1, 2, 3], fill=3, durable=False)  # v2, not durable
    gate.set()
    t.drain()
    assert t.l3 is not None
    assert t.l3.get(cache_key(IDENT, encode_tokens([1, 2, 3]))) is None, "v1 was skipped"
    assert served_digest(t, [1, 2, 3]) == newest


def test_a_durable_write_in_flight_when_its_key_is_captured_again_is_withdrawn(
    tiers: tuple[Tiers, threading.Event],
) -> None:
    t, gate = tiers
    capture(t, [1, 2, 3], fill=2, durable=True)  # v1: the writer picks it up and waits at the gate
    time.sleep(0.2)
    newest = capture(t, [1, 2, 3], fill=3, durable=False)  # v2 while v1 is being written
    gate.set()
    t.drain()
    assert t.l3 is not None
    assert t.l3.get(cache_key(IDENT, encode_tokens([1, 2, 3]))) is None
    assert served_digest(t, [1, 2, 3]) == newest


def test_l3_is_the_authority_over_a_disagreeing_l2_entry(tiers: tuple[Tiers, threading.Event]) -> None:
    t, gate = tiers
    gate.set()
    durable = capture(t, [5, 6], fill=7, durable=True)
    t.drain()
    key = cache_key(IDENT, encode_tokens([5, 6]))
    decls, source = staged(8)
    with t.l2.reserve(key=key, identity=IDENT, token_count=2, tensors=decls) as r:  # behind the rules' back
        r.data[: len(source)] = source
        r.commit()
    assert served_digest(t, [5, 6]) == durable
    assert t.counters.l2_mismatches_removed == 1
