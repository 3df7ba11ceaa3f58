"""The digester: BLAKE3 of the blocks a put committed unhashed, computed off the request path.

A put copies each new block into a slot only the daemon writes and commits it at once; hashing every
byte (≈ 2× the cost of the copy here) would otherwise sit on the put's request path. The digest is what
adoption after a restart and the L3 copy check, never what a get serves, so the put leaves it to this
thread while the blocks it has still to hash stay under ``backlog`` bytes (past that a put hashes its
own blocks, as before: the backlog is bounded, and a put never waits behind it). The thread hashes the
oldest first, a step at a time, each step's slots leased so that no put can reuse them meanwhile. It
never starts while a put or an L3 read fills slots (as the reserve does): it is woken as the last one
ends, and runs as the quiet window after it closes (2 ms; it waits for exactly that, never a poll), so a
put's blocks are hashed within a few milliseconds of its answer; a put that begins meanwhile finds it
gone after the block in hand (it looks before each block). The
durable writer hashes any block it writes before the digester got to it (and takes it from the digester
while it does, so no block is hashed twice); :meth:`Digester.close` hashes
what is left, so a clean stop leaves every record with its digest.
"""

from __future__ import annotations

from skippyd.workers import Health, Wakeable

from .tier import L2Tier

__all__ = ["Digester"]

THREAD = "skippyd-l2-digests"
_STEP_BYTES = 16 << 20  # hashed per step at most (the tier's lock is taken between steps, not during)


class Digester(Wakeable):
    thread_name = THREAD
    failure = "hashing L2 blocks failed"

    def __init__(self, tier: L2Tier, backlog: int, health: Health, *, interval: float = 0.05) -> None:
        super().__init__(health, interval=interval)
        self.tier = tier
        self.backlog = backlog  # unhashed bytes a put may leave behind it; 0: every put hashes its blocks
        self._again: float | None = None  # when the last drain wants to run again (None: when woken)

    def may_defer(self, nbytes: int) -> bool:
        """Whether a put of ``nbytes`` new bytes may commit them unhashed (call under the tier's lock)."""
        return not self.stopping and self.tier.blocks.unhashed_bytes + nbytes <= self.backlog

    def start(self) -> None:
        if self.backlog > 0:
            self.tier.blocks.idle_hooks.append(self.wake)
            self.start_thread()

    def drain(self, *, wait_idle: bool = True) -> int:
        """Hashes unhashed blocks, oldest first, until none is left (or, with ``wait_idle``, until a put
        or an L3 read begins: checked before each block, so one that begins meanwhile finds the thread
        gone within one block's hashing); returns how many."""
        done = 0
        blocks = self.tier.blocks
        stop = (lambda: blocks.filling) if wait_idle else None
        self._again = None
        while not (wait_idle and self.stopping):
            with self.tier.lock:
                if wait_idle:
                    quiet = blocks.quiet_in()
                    if quiet != 0.0:  # a put fills slots (its end wakes us) or ended a moment ago
                        self._again = quiet
                        break
                job = blocks.digest_take(_STEP_BYTES)
            if job is None:
                break
            hashed: list[bytes] = []
            try:
                hashed = job.hash(stop)
                with self.tier.lock:
                    blocks.record_digests(
                        (key, slab, index, digest)
                        for (key, slab, index, _), digest in zip(job.items, hashed, strict=False)
                    )
                    # (what a put's start left unhashed goes back to the next step)
                    blocks.hashing_ended(key for key, _, _, _ in job.items[len(hashed) :])
                done += len(hashed)
            except BaseException:  # a failed step leaves its blocks to the next one
                with self.tier.lock:
                    blocks.hashing_ended(key for key, _, _, _ in job.items)
                raise
            finally:
                job.close()
        return done

    def job(self) -> float | None:
        """One wake-up: hash until nothing is left or a put begins; then wait for the put's end (its
        wake-up), or, if one ended a moment ago, for exactly the rest of its quiet window."""
        self.drain()
        return self._again

    def close(self) -> None:
        """Stops the thread and hashes what is left (a clean stop leaves no record without its digest)."""
        self.stop_thread()
        with self.health.guard(THREAD, "hashing L2 blocks at shutdown failed"):
            self.drain(wait_idle=False)
