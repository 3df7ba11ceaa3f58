"""The reserve: pre-faulted free memory kept ahead of demand, so no put faults pages on its request path,
and no more of it than the next seconds of puts need.

Faulting fresh tmpfs pages runs at ≈ 1 GB/s on these machines against ≈ 12 GB/s for rewriting mapped
memory. A background thread keeps free, pre-faulted block slots of each block group and free entry files
of each size class, as many bytes as puts (and L3 reads landing in L2) or new entries took of that kind
within the last ``window`` seconds (a group a restart expects reads into, see ``Tiers``: as much as the
cap allows, for a minute), all of them together at most ``limit`` bytes (the cap: targets are scaled
down to fit it). It faults only while the L2 budget has room without evicting anything and no put or L3
read is filling slots (it wakes as the last one ends, waits out the quiet window after it, and yields as
the next one begins: it faults one slot or file at a time), at most ``rate`` bytes a second and for at
most a ``share`` of the time (its CPU: faulting is kernel time, ≈ 1 s of a core per GB on an idle
machine, several times that on a loaded one, where the share makes it back off). Free memory beyond the
targets, whatever freed it (a removal, an eviction's leftovers, demand that stopped), is given back a
slot or a file at a time, so the reserve decays to nothing within ``window`` seconds of the last put.
That memory is also the first given back when anything else needs room.
"""

from __future__ import annotations

import time

from skippyd.workers import Health, Pacer, Wakeable

from .tier import L2Tier

__all__ = ["Reserve"]

THREAD = "skippyd-l2-reserve"
_STEP_BYTES = 64 << 20  # faulted or given back per wake-up at most, so one job never runs for long


class Reserve(Wakeable):
    thread_name = THREAD
    failure = "filling the L2 reserve failed"

    def __init__(
        self,
        tier: L2Tier,
        limit: int,
        health: Health,
        *,
        window: float = 10.0,
        rate: int = 0,
        share: float = 0.0,
        interval: float = 0.05,
    ) -> None:
        super().__init__(health, interval=interval)
        self.tier = tier
        self.limit = limit  # the cap on free pre-faulted memory kept ready
        self.window = window  # seconds of recent demand kept ready
        self.pacer = Pacer(rate, share=share)  # bytes a second, and share of the time, it faults at most

    def start(self) -> None:
        if self.limit > 0:
            # refill right after a put, not an interval later
            self.tier.blocks.idle_hooks.append(self.wake)
            self.start_thread()

    def give_back(self) -> int:
        """Gives back free memory beyond the targets (up to one step); returns the bytes."""
        given = 0
        while given < _STEP_BYTES and not self.stopping:
            step = self.tier.give_back_step(self.limit, window=self.window)
            if not step:
                break
            given += step
        return given

    def fill(self) -> tuple[int, float | None]:
        """Faults in what the targets lack (up to one step, within the rate); returns the bytes added and
        when to run again (as :meth:`job` does)."""
        added = 0
        blocks = self.tier.blocks
        while added < _STEP_BYTES and not self.stopping:
            wait = self.pacer.delay()
            if wait > 0:
                return added, wait
            with self.tier.lock:
                quiet = blocks.quiet_in()
            if quiet != 0.0:  # a put fills slots (its end wakes us) or ended a moment ago
                return added, quiet
            began = time.monotonic()
            step = self.tier.prefault_step(self.limit, window=self.window)
            if not step:  # nothing to do, or a put began (its end wakes us)
                return added, None
            self.pacer.spent(step, began)
            added += step
        return added, 0.0

    def job(self) -> float | None:
        """One wake-up: give back what is beyond the targets, then fill what they lack; while a put fills
        slots, wait for its end (its wake-up), and for exactly the rest of the quiet window after it."""
        with self.tier.lock:
            quiet = self.tier.blocks.quiet_in()
        if quiet != 0.0:
            return quiet
        self.give_back()
        return self.fill()[1]

    def close(self) -> None:
        self.stop_thread()
