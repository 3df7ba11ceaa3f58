"""Moved to :mod:`skippyd.client.tensors`; this name stays so that code written against it keeps working.

It is the same module object (``import skippyd.tensors`` gives ``skippyd.client.tensors``), not a copy.
"""

from __future__ import annotations

import sys

from .client import tensors as _moved
from .client.tensors import *  # noqa: F403 - the names, for type checkers

sys.modules[__name__] = _moved
