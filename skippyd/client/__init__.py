"""The client side: what an engine process links in to talk to its host's daemon (never the daemon).

* :mod:`.client`: ``Client`` and ``AsyncClient`` over one sans-I/O core (request bodies, reply parsers,
  the retry rule), the connection's staging buffer, restores and captures of whole entries.
* :mod:`.blockspace`: ``BlockSpace`` and ``AsyncBlockSpace``, chained blocks (an engine's pages) put,
  looked up and read zero-copy or into the engine's own memory.
* :mod:`.tensors` (imports torch): torch tensors ⇄ an entry's bytes.
* :mod:`.transfer`: the GPU data path between skippyd's shared memory and a device.

Importing this package loads neither torch nor CUDA; :mod:`.tensors` and :mod:`.transfer.device` load
torch when a call first needs it.
"""

from __future__ import annotations

from .blockspace import AsyncBlockSpace, BlockSpace, BlocksPut
from .client import DEFAULT_SOCKET, AsyncClient, CaptureResult, Client, Hit, Restored, resolve_socket_path

__all__ = [
    "DEFAULT_SOCKET",
    "AsyncBlockSpace",
    "AsyncClient",
    "BlockSpace",
    "BlocksPut",
    "CaptureResult",
    "Client",
    "Hit",
    "Restored",
    "resolve_socket_path",
]
