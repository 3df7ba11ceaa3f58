"""Low-level shared-memory file handling for the L2 tier and staging buffers.

Two kernel facts carry the design (docs/architecture.md, "Leases"):

* A reader's lease is a read lock (``F_OFD_SETLK``, ``F_RDLCK`` over the whole file) taken on a fresh
  read-only open file description before the daemon sends it. A mapping holds a reference to its open
  file description, so the lock lives exactly as long as the reader keeps the fd *or any mapping made
  from it*; it dies with the reader's process. The daemon asks the kernel "is anyone still reading this
  file?" with a non-blocking write lock through a read-write description of its own, and only reuses a
  file's pre-faulted pages when nobody is. A client cannot take a write lock through the read-only
  description it was given, so it can never hold the daemon's leases or probes up (an ``flock``, which
  ignores the access mode, let one client's ``LOCK_EX`` stall the tier and kill the L3 writer); an
  ``flock`` a client takes anyway only counts as a reader (the file is unlinked instead of reused).
* Writing through a mapping of a tmpfs file whose pages are not allocated raises SIGBUS when tmpfs is
  full, so new files are ``fallocate``d first: ENOSPC comes back as an error, never as a signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .errors import Busy, NoSpace
from .files import remove

__all__ = [
    "ACL_XATTR",
    "PAGE",
    "allocate_file",
    "allocate_mapped",
    "copy_bytes",
    "create_shared",
    "has_readers",
    "map_rw",
    "memfd",
    "new_name",
    "next_generation",
    "ofd_lock",
    "open_reader",
    "populate_write",
    "read_acl",
    "reopen_readonly",
    "seal_readonly",
    "set_copy_threads",
    "share",
    "share_with",
    "size_class",
    "zero",
]

PAGE = mmap.PAGESIZE
_SMALL_LIMIT = 64 * 1024
_STEPS_PER_DOUBLING = 8


def size_class(nbytes: int) -> int:
    """The file size an entry of ``nbytes`` occupies: pages up to 64 KiB, then 8 classes per doubling.

    Recycled files are matched by class, so entries of similar size reuse each other's pre-faulted pages;
    the rounding wastes at most 12.5% (and under a page for small entries). Classes are counted past the
    first page, which holds the header, so a power-of-two payload plus its header page fits exactly.
    """
    if nbytes <= _SMALL_LIMIT:
        return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
    body = nbytes - PAGE
    top = 1 << (body.bit_length() - 1)
    step = max(PAGE, top // _STEPS_PER_DOUBLING)
    return PAGE + (body + step - 1) // step * step


#: Generations of slabs and entry files (docs/protocol.md, "Generations"): one counter for the whole
#: process, started at the wall clock's nanoseconds, so a number is never given twice in one process and
#: a restarted daemon starts past every number the last one gave (unless the clock went back).
_generations = itertools.count(time.time_ns())


def next_generation() -> int:
    """A generation number no file or slab of this daemon had before (thread-safe under the GIL)."""
    return next(_generations)


def new_name(suffix: str) -> str:
    """A random file name; no client text ever becomes part of a path."""
    return f"{secrets.token_hex(12)}{suffix}"


#: The group the files clients are handed (entries, slabs) are given (-1: the daemon's own).
_SHARED_GID = [-1]
#: The POSIX ACL (``system.posix_acl_access``) they are given: read for ``allowed_uids``/``allowed_gids``
#: (empty: none; :func:`share_with`).
_SHARED_ACL = [b""]
#: Their mode: readable by that group, so a client of another user in it (the socket's group) can open a
#: descriptor it was handed again (``/proc/self/fd``) and keep a mapping through a description of its own,
#: which holds no lease (skippyd.client.transfer.map_without_leases; mapping the reply's own would keep its
#: leases, and with 0600 files the client had to read through the reply's descriptor every call). No new
#: reach: the directories stay 0700, so only a descriptor the daemon handed over leads to a file.
SHARED_MODE = 0o640

ACL_XATTR = "system.posix_acl_access"
# the kernel's POSIX ACL xattr (linux/posix_acl_xattr.h): version 2, then (tag u16, perm u16, id u32)
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = (
    0x01,
    0x02,
    0x04,
    0x08,
    0x10,
    0x20,
)
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def read_acl(uids: tuple[int, ...] = (), gids: tuple[int, ...] = ()) -> bytes:
    """The ``system.posix_acl_access`` value of :data:`SHARED_MODE` plus read for each of ``uids`` and
    ``gids`` (empty when there are none: the mode alone says it)."""
    uids, gids = tuple(sorted(set(uids))), tuple(sorted(set(gids)))
    if not uids and not gids:
        return b""
    entries = [(_ACL_USER_OBJ, 6, _ACL_UNDEFINED_ID)]
    entries += [(_ACL_USER, 4, uid) for uid in uids]
    entries.append((_ACL_GROUP_OBJ, 4, _ACL_UNDEFINED_ID))
    entries += [(_ACL_GROUP, 4, gid) for gid in gids]
    entries += [(_ACL_MASK, 4, _ACL_UNDEFINED_ID), (_ACL_OTHER, 0, _ACL_UNDEFINED_ID)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def share_with(gid: int, uids: tuple[int, ...] = (), gids: tuple[int, ...] = ()) -> None:
    """Files clients are handed go to group ``gid`` from now on (the socket's; -1: the daemon's own), and
    are readable by each of ``uids`` and ``gids`` (``allowed_uids``/``allowed_gids``) through a POSIX ACL,
    so a client allowed by its id alone keeps a lease-free mapping as one in the group does."""
    _SHARED_GID[0] = gid
    _SHARED_ACL[0] = read_acl(uids, gids)


def share(fd: int, *, adopted: bool = False) -> None:
    """Gives a file clients will be handed its mode, group (:data:`SHARED_MODE`) and ACL, as far as it
    can: a mode, group or ACL refused (a group the daemon is not in, an LSM, a gid a user namespace does
    not map, a filesystem without POSIX ACLs) is logged once and left as it is; such clients read through
    the reply's descriptor, nothing else changes (never a reason to fail a put or to drop a file at
    adoption). An ``adopted`` file (an earlier daemon's) loses an ACL this daemon's ids no longer name."""
    acl = _SHARED_ACL[0]
    try:
        os.fchmod(fd, SHARED_MODE)
        if _SHARED_GID[0] >= 0:
            os.fchown(fd, -1, _SHARED_GID[0])
        if acl:
            os.setxattr(fd, ACL_XATTR, acl)
        elif adopted:
            with contextlib.suppress(OSError):  # (none there: ENODATA; no ACLs here: EOPNOTSUPP)
                os.removexattr(fd, ACL_XATTR)
    except OSError as exc:
        if not _share_refused:
            _share_refused.append(exc.errno or 0)
            logging.getLogger(__name__).warning(
                "cannot give the files clients are handed mode %o, group %d%s (%s): clients of other users "
                "will read through each reply's descriptor", SHARED_MODE, _SHARED_GID[0],
                " and read for allowed_uids/allowed_gids (a POSIX ACL)" if acl else "", exc.strerror,
            )  # fmt: skip


_share_refused: list[int] = []


def create_shared(path: Path) -> int:
    """Creates ``path`` (exclusive, never through a link), a file clients will be handed (:func:`share`d);
    returns an O_RDWR fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    share(fd)
    return fd


def allocate_file(path: Path, size: int) -> int:
    """Creates ``path`` (:func:`create_shared`) and allocates ``size`` bytes of it; returns an O_RDWR fd.

    On ENOSPC the file is removed and :class:`NoSpace` raised, so a full tmpfs leaves nothing behind.
    """
    fd = create_shared(path)
    try:
        fallocate(fd, 0, size, f"in {path.parent}")
    except OSError:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return fd


def fallocate(fd: int, offset: int, length: int, where: str) -> None:
    """``posix_fallocate``: a full tmpfs (or disk) is :class:`NoSpace`, saying ``where``."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise NoSpace(f"no space for {length} bytes {where}: {exc.strerror}") from exc
        raise


def fill_holes(fd: int, size: int, *, start: int = 0) -> None:
    """Gives bytes ``[start, start + size)`` of a tmpfs file their pages now where it has holes (a file
    copied with ``cp --sparse``/``rsync -S``, or made by hand, next to what this daemon writes): a
    write through a mapping into a hole faults a page in, and on a full tmpfs that is SIGBUS, the
    daemon gone. :class:`NoSpace` when the tmpfs cannot give them (drop the file); ``fd`` is writable."""
    st = os.fstat(fd)
    if start == 0 and size >= st.st_size and st.st_blocks * 512 >= st.st_size:
        return  # (every page of the file there already: the common case, one fstat)
    fallocate(fd, start, size, "to fill the holes of an adopted file")


def map_rw(fd: int, size: int) -> mmap.mmap:
    """A shared read-write mapping of the first ``size`` bytes of ``fd``."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86-64/aarch64 (F_OFD_* locks)


def ofd_lock(fd: int, kind: int, start: int = 0, length: int = 0) -> bool:
    """An open-file-description lock (``fcntl.F_RDLCK``, ``F_WRLCK`` or ``F_UNLCK``) on ``[start,
    start + length)`` of ``fd`` (``length`` 0: to the end and beyond), without waiting: False when another
    description holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def open_reader(path: Path) -> int:
    """A fresh read-only description of ``path`` holding a read lease on the whole file; the caller owns
    the fd."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        # The only write lock a read-only client description cannot take, so the one it can meet is
        # has_readers()' momentary probe (the daemon's own): wait it out, briefly.
        for attempt in range(200):
            if ofd_lock(fd, fcntl.F_RDLCK):
                return fd
            time.sleep(0 if attempt < 20 else 0.0005)
        raise Busy(f"could not take a read lease on {path.name}: the file is being recycled")
    except BaseException:
        os.close(fd)
        raise


def has_readers(path: Path) -> bool:
    """Whether any process still holds a lease (an fd or a mapping) on ``path``: a read lock of
    :func:`open_reader`'s, or an ``flock`` (a daemon before read locks, or a client's own ``flock``: a
    file someone locks is never reused under them)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        if not ofd_lock(fd, fcntl.F_WRLCK):
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    finally:
        os.close(fd)  # closing drops our probes with the description
    return False


def zero(buffer: memoryview, start: int, stop: int) -> None:
    """Writes zeros over ``buffer[start:stop]`` (releasing the GIL for large spans)."""
    if stop <= start:
        return
    import numpy as np

    np.frombuffer(buffer, dtype=np.uint8, count=stop - start, offset=start).fill(0)


_PARALLEL_COPY_BYTES = 8 << 20
_pools: list[ThreadPoolExecutor] = []
_pool_lock = threading.Lock()
_pool_threads = [min(8, os.cpu_count() or 2)]


def set_copy_threads(threads: int) -> None:
    """Sizes the copy pool for copies and faults split over ``threads`` (the daemon's ``copy_threads``):
    the calling thread runs one share, the pool the others. Set before the pool is first used."""
    with _pool_lock:
        _pool_threads[0] = max(1, threads - 1, min(8, os.cpu_count() or 2))


def _copy_pool() -> ThreadPoolExecutor:
    with _pool_lock:
        if not _pools:
            _pools.append(ThreadPoolExecutor(max_workers=_pool_threads[0], thread_name_prefix="skippyd-copy"))
        return _pools[0]


def copy_bytes(dst: Any, src: Any, threads: int = 1) -> None:
    """memcpy ``src`` into ``dst`` (equal-sized buffers) with numpy, split over ``threads`` for large copies.

    numpy releases the GIL while it copies, so the event loop keeps running and the split halves really
    run on separate cores (one core alone does not saturate memory bandwidth).
    """
    import numpy as np

    target = np.frombuffer(dst, dtype=np.uint8)
    source = np.frombuffer(src, dtype=np.uint8)
    if target.nbytes != source.nbytes:
        raise ValueError(f"copy of {source.nbytes} bytes into {target.nbytes}")
    size = target.nbytes
    if threads <= 1 or size < _PARALLEL_COPY_BYTES:
        np.copyto(target, source)
        return
    step = -(-size // threads)
    step = (step + PAGE - 1) // PAGE * PAGE
    starts = range(0, size, step)
    pool = _copy_pool()
    futures = [pool.submit(np.copyto, target[i : i + step], source[i : i + step]) for i in starts[1:]]
    np.copyto(target[:step], source[:step])
    for future in futures:
        future.result()


_MADV_POPULATE_WRITE = 23  # Linux 5.14; an older kernel just faults on first write
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate_write(mapping: mmap.mmap, offset: int, length: int) -> bool:
    """Faults ``length`` bytes of a shared writable mapping in from ``offset`` (page-aligned), ready to be
    written at memory speed; False where the kernel cannot (before 5.14) or the range is gone.

    ``mmap.madvise`` keeps the GIL through the call, and faulting fresh tmpfs pages runs at ≈ 1 GB/s
    here: 2 ms of a 2 MiB slot during which no other thread of the daemon ran. Through ctypes the GIL is
    released; the buffer export held for the call keeps the mapping from being closed under it.
    """
    return _populate(mapping, offset, length) == 0


def _populate(mapping: mmap.mmap, offset: int, length: int) -> int:
    """:func:`populate_write`, saying why not: 0, or the errno (``EFAULT``: a page could not be given, a
    full tmpfs; ``EINVAL``: a kernel before 5.14, or a mapping that is closed or not writable)."""
    if length <= 0:
        return 0
    try:
        window = (ctypes.c_char * length).from_buffer(mapping, offset)
    except (TypeError, ValueError):  # closed, or not writable
        return errno.EINVAL
    try:
        if _libc.madvise(ctypes.addressof(window), length, _MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno() or errno.EINVAL
    finally:
        del window


#: Fresh files at least this large are faulted in by several threads (:func:`allocate_mapped`).
PARALLEL_ALLOCATE_BYTES = 32 << 20


def allocate_mapped(path: Path, size: int, *, threads: int = 1) -> mmap.mmap:
    """Creates ``path`` (:func:`create_shared`) with ``size`` bytes allocated, and returns a shared
    read-write mapping of it with every page faulted in (written at memory speed from then on).
    :class:`NoSpace` when the tmpfs has no room for them (the file removed: a full tmpfs leaves nothing
    behind).

    ``fallocate`` gives a tmpfs file its pages under the file's lock, one thread, at ≈ 3 GB/s here, and a
    copy into pages it allocated still faults each one into the mapping. From
    :data:`PARALLEL_ALLOCATE_BYTES` on, with ``threads``, the file is instead faulted in chunk by chunk
    by that many threads at once (``MADV_POPULATE_WRITE`` allocates each page it faults: a page the tmpfs
    cannot give is ``EFAULT``, never SIGBUS); a kernel without it falls back to ``fallocate``.
    """
    if threads <= 1 or size < PARALLEL_ALLOCATE_BYTES:
        fd = allocate_file(path, size)
        try:
            return map_rw(fd, size)
        except BaseException:
            remove(path)
            raise
        finally:
            os.close(fd)
    fd = create_shared(path)
    mapping: mmap.mmap | None = None
    try:
        os.ftruncate(fd, size)
        mapping = map_rw(fd, size)
        failed = _populate_at_once(mapping, size, threads)
        if failed in (errno.EFAULT, errno.ENOMEM):
            raise NoSpace(f"no space for {size} bytes in {path.parent}: the tmpfs is full")
        if failed:  # (no MADV_POPULATE_WRITE: what was faulted in stays, fallocate gives the rest)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise NoSpace(f"no space for {size} bytes in {path.parent}: {exc.strerror}") from exc
                raise
        return mapping
    except BaseException:
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        remove(path)
        raise
    finally:
        os.close(fd)


def _populate_at_once(mapping: mmap.mmap, size: int, threads: int) -> int:
    """Faults ``mapping`` in, chunks of it on ``threads`` threads (the copy pool's); the first errno."""
    chunk = max(8 << 20, -(-size // (threads * 4)) // (2 << 20) * (2 << 20))
    starts = list(range(0, size, chunk))
    shares = [starts[i::threads] for i in range(min(threads, len(starts)))]

    def run(share: list[int]) -> int:
        for start in share:
            failed = _populate(mapping, start, min(chunk, size - start))
            if failed:
                return failed
        return 0

    if threading.current_thread().name.startswith("skippyd-copy"):  # (a pool task never waits on the pool)
        return next((failed for failed in map(run, shares) if failed), 0)
    futures: list[Future[int]] = []
    try:
        for share_ in shares[1:]:
            futures.append(_copy_pool().submit(run, share_))
        first = run(shares[0])
    finally:
        wait(futures)
    return first or next((f.result() for f in futures if f.result()), 0)


def memfd(name: str, size: int, *, seal: bool = True) -> int:
    """An anonymous shared-memory fd of ``size`` bytes that nobody can shrink or grow.

    Used for staging buffers: the peer may write into it, but a truncation under the daemon's mapping
    (which would SIGBUS the daemon) is refused by the seals. With ``seal=False`` the seals are left to
    the caller (:func:`seal_readonly` once the daemon has filled it).
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.posix_fallocate(fd, 0, size)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise NoSpace(f"no memory for a {size}-byte staging buffer") from exc
        raise
    return fd


def seal_readonly(fd: int) -> None:
    """Seals a filled memfd against every change: no writes (by anyone, through any fd), no resizing.

    The daemon must have unmapped its own writable mappings first (the kernel refuses the write seal
    while one exists).
    """
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


def reopen_readonly(fd: int) -> int:
    """A new read-only open file description of the file behind ``fd`` (for handing to a client)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
