"""``python lock_holder.py -m skippyd serve ...``: the daemon, with a test hook that holds the L2 tier's
lock ``SKIPPYD_TEST_HOLD_MS`` at a time (2 ms apart) while the file ``SKIPPYD_TEST_HOLD_FILE`` names
exists, as the block writer, a recency flush or the reserve hold it in turn (tests/test_put_behind.py)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import skippyd.tiers

_init = skippyd.tiers.Tiers.__init__


def _holding(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    path = os.environ["SKIPPYD_TEST_HOLD_FILE"]
    hold = float(os.environ.get("SKIPPYD_TEST_HOLD_MS", "300")) / 1e3

    def run() -> None:
        while True:
            if os.path.exists(path):
                with self.l2.lock:
                    time.sleep(hold)
                time.sleep(0.002)
            else:
                time.sleep(0.01)

    threading.Thread(target=run, daemon=True, name="test-lock-holder").start()


skippyd.tiers.Tiers.__init__ = _holding  # type: ignore[method-assign]

if __name__ == "__main__":
    from skippyd.cli import main

    args = sys.argv[1:]
    if args[:2] == ["-m", "skippyd"]:
        args = args[2:]
    sys.argv = ["skippyd", *args]
    main()
