"""Moved to :mod:`skippyd.client.blockspace`; this name stays so that code written against it keeps working.

It is the same module object (``import skippyd.blockspace`` gives ``skippyd.client.blockspace``), not a copy.
"""

from __future__ import annotations

import sys

from .client import blockspace as _moved
from .client.blockspace import *  # noqa: F403 - the names, for type checkers

sys.modules[__name__] = _moved
