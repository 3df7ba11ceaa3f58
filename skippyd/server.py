"""The daemon's event loop: the listening socket, connections, signals and systemd notification.

One asyncio loop drives non-blocking sockets directly (``add_reader``/``add_writer``, ``recv`` and
``sendmsg``) so replies can carry file descriptors, which asyncio's transports cannot. Requests of one
connection run in order; operations whose cost grows with payload or prompt size run on worker
threads, everything else inline. Per connection, at most one frame is buffered on input and a bounded
amount of replies on output: a client that stops reading only stops its own requests.

Lifecycle (``uvicorn``-style): :class:`Server` is built from a :class:`~skippyd.config.Config` and the
handlers; :meth:`Server.serve` publishes the socket atomically (bind a temporary name, chmod 0660,
rename into place), tells systemd ``READY=1``, and runs until SIGTERM/SIGINT. The first signal stops
accepting, lets in-flight requests finish within ``shutdown_timeout`` and exits; a second one forces it
(one within half a second of the first counts as the same signal delivered twice).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import grp
import logging
import os
import resource
import secrets
import signal
import socket
import stat
import struct
import termios
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .blocks import SETTLE_SECONDS
from .config import Config
from .errors import Busy, PermissionDenied, ShuttingDown, SkippydError, StoreLocked, VersionMismatch
from .handlers import STAGED_OPS, Behind, Deferred, Handler, Handlers, Reply, Session
from .protocol import MAX_REQUEST_ITEMS, Frame, FrameDecoder, FrameType, encode_frame, send_frame
from .stats import ServerState
from .systemd import notify, watchdog_interval
from .workers import Health

__all__ = ["Server", "check_socket_free", "publish_socket"]

log = logging.getLogger("skippyd.server")

_RECV_SIZE = 256 * 1024
_MAX_OUT_BYTES = 8 << 20
#: Descriptors replies may hold while they wait for a client to read them: past this, a connection's
#: queued requests wait (a client pipelining gets and never reading would otherwise hold the daemon's
#: descriptors until it has none left for anyone).
_MAX_OUT_FDS = 64
#: Descriptors sent in replies a client has not read yet: they sit in its socket, and the kernel counts
#: them against the daemon's user (past its open-files limit every ``sendmsg`` of a descriptor fails
#: ``ETOOMANYREFS``, for every client; root with CAP_SYS_RESOURCE is exempt). Past this, or past the
#: server's share (``max_out_fds``, all connections together), a connection's queued requests wait until
#: its client has read what it was sent (``SIOCOUTQ`` says 0), looked at again every few ms.
_MAX_UNREAD_FDS = 256
_UNREAD_LOOK_S = (0.001, 0.02)  # the first and the longest wait between two looks
_MAX_QUEUED_FRAMES = 64
_MAX_QUEUED_BYTES = 32 << 20  # decoded requests waiting on one connection
_MAX_CONNECTIONS = 2048
_ACCEPT_PAUSE_S = 0.5  # how long accepting rests when the daemon is out of descriptors or memory
#: A second stop signal this soon after the first is the same one delivered twice (a wrapper such as
#: ``timeout`` forwarding its process group's SIGINT), not an operator asking to exit at once.
_SAME_SIGNAL_S = 0.5
_MAX_CONNECTIONS_PER_UID = 1024  # one local user cannot take every slot from the others
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


@dataclass
class PublishedSocket:
    sock: socket.socket
    path: Path
    inode: int
    lock_fd: int
    closed: bool = False

    def close(self) -> None:
        """Idempotent: closing a descriptor number twice could close another thread's file."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def publish_socket(path: Path, *, group: str = "", mode: int = 0o660, backlog: int = 512) -> PublishedSocket:
    """Binds, chmods (0660) and renames the listening socket into place; refuses if a live daemon answers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise StoreLocked(f"another skippyd is starting or serving on {path}") from None
    try:
        _check_existing(path)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(os.fspath(temp))
            os.chmod(temp, mode)
            if group:
                os.chown(temp, -1, grp.getgrnam(group).gr_gid)
            sock.listen(backlog)
            sock.setblocking(False)
            os.rename(temp, path)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        return PublishedSocket(sock, path, os.lstat(path).st_ino, lock_fd)
    except BaseException:
        os.close(lock_fd)
        raise


def check_socket_free(path: Path) -> None:
    """Refuses (:class:`StoreLocked`) when a live daemon answers on ``path`` or something that is not a
    socket sits there; a stale socket is fine (it is replaced when the socket is published)."""
    _check_existing(path)


def _check_existing(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StoreLocked(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("replacing the stale socket %s", path)
        return
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return
        raise
    finally:
        probe.close()
    raise StoreLocked(f"a live daemon answers on {path}; refusing to start a second one")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, tuple[int, ...]]:
    """(pid, uid, gid, supplementary gids) of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    with contextlib.suppress(OSError):
        blob = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 256)
        groups = struct.unpack(f"{len(blob) // 4}I", blob[: len(blob) // 4 * 4])
    return pid, uid, gid, groups


class PeerPolicy:
    """Who may talk to the daemon: by default its own user, root, and members of the socket's group."""

    def __init__(self, config: Config, socket_gid: int) -> None:
        self.uids = set(config.allowed_uids)
        self.gids = set(config.allowed_gids)
        self.default = not self.uids and not self.gids
        self.own_uid = os.geteuid()
        self.socket_gid = socket_gid

    def allows(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        if uid in (0, self.own_uid):
            return True
        peer_groups = {gid, *groups}
        if self.default:
            return self.socket_gid in peer_groups
        return uid in self.uids or bool(self.gids & peer_groups)


def unread_by_peer(fd: int) -> int:
    """How much of what this socket sent its peer has not read yet (``SIOCOUTQ``: 0 once it has read
    everything, or closed); -1 where the socket cannot say."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return -1


class Connection:
    def __init__(self, server: Server, sock: socket.socket, session: Session) -> None:
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()
        self.session = session
        self.decoder = FrameDecoder(
            server.config.max_frame, expect=(FrameType.REQUEST,), max_items=MAX_REQUEST_ITEMS
        )
        self.queue: deque[Frame] = deque()
        self.queued_bytes = 0
        self.partial = 0  # bytes of unfinished and not yet run frames, counted in server.partial_bytes
        self.running = False
        self.out: deque[tuple[memoryview, list[int]]] = deque()
        self.out_bytes = 0
        self.out_fds = 0  # descriptors held by replies in ``out``
        self.unread_fds = 0  # descriptors sent since the client was last seen to have read everything
        self._look_timer: asyncio.TimerHandle | None = None
        self._look_wait = _UNREAD_LOOK_S[0]
        self.refused_refs = False  # the kernel refused the last descriptors (ETOOMANYREFS): sent again later
        self.reading = False
        self.writing = False
        self.closed = False
        self.close_after_flush = False
        self.last_activity = time.monotonic()
        self.frame_started = 0.0
        self.counted = False  # in the server's per-uid connection count
        # The copy behind this connection's last staged put (out of its staging half, then the commit),
        # while it runs: the next staged request's reply waits for it (the client then writes the half
        # it read), every other request waits for it before it runs (a client sees its own puts).
        self.copy: Future[object] | None = None
        self.held: Callable[[], None] | None = None  # a staged request's reply, waiting for self.copy

    # ------------------------------------------------------------- reading
    def start(self) -> None:
        self._resume_reading()

    def _resume_reading(self) -> None:
        if not self.reading and not self.closed and not self.close_after_flush and not self.server.stopping:
            self.server.loop.add_reader(self.fd, self.on_readable)
            self.reading = True
            if self.decoder.mid_frame:  # the frame clock was stopped while we were not reading
                self.frame_started = time.monotonic()

    @property
    def waiting_on_us(self) -> bool:
        """Reading is paused because this connection's earlier requests are still running or queued
        (not because the client stopped reading its replies): its frame clock does not run."""
        return not self.reading and not self.closed and not self._replies_backed_up()

    def _pause_reading(self) -> None:
        if self.reading:
            self.server.loop.remove_reader(self.fd)
            self.reading = False

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        if self.unread_fds:  # (a client asking again has mostly read what it was sent: the count stays true)
            self._peer_read_all()
        decoder = self.decoder
        now = time.monotonic()
        self.last_activity = now
        continuing = decoder.mid_frame
        decoder.feed(data)
        queue = self.queue
        completed = 0
        while True:
            try:
                frame = decoder.next_frame()
            except SkippydError as exc:
                self._protocol_error(exc)
                return
            if frame is None:
                break
            queue.append(frame)
            self.queued_bytes += frame.size
            completed += 1
        if decoder.mid_frame and (completed or not continuing):
            # the clock runs from the first byte of a frame: trickling bytes does not reset it
            self.frame_started = now
        self._account_partial(decoder.buffered + self.queued_bytes)
        if self.server.partial_bytes > self.server.config.max_buffered and (decoder.mid_frame or queue):
            # Clients are holding large requests unanswered or half-sent, more than the daemon buffers:
            # shed the ones holding the most (a client that crossed the line with a small request is
            # not the one to blame), then this one if it still does not fit.
            self.server.shed_largest_buffers(self)
            if self.closed or self.close_after_flush:
                return
        if not self._has_room():
            self._pause_reading()
        self._run_next()

    def _account_partial(self, buffered: int) -> None:
        self.server.partial_bytes += buffered - self.partial
        self.partial = buffered

    def _has_room(self) -> bool:
        return (
            len(self.queue) < _MAX_QUEUED_FRAMES
            and self.queued_bytes <= _MAX_QUEUED_BYTES
            and not self._replies_backed_up()
        )

    def _replies_backed_up(self) -> bool:
        """The client is not reading its replies: this connection's next requests wait until it does."""
        held = self.out_fds
        return (
            self.out_bytes > _MAX_OUT_BYTES
            or held > _MAX_OUT_FDS
            or (held > 0 and self.server.out_fds > self.server.max_out_fds)  # (many such clients at once)
            or self.refused_refs
            or self._unread_fds_over()
        )

    def _unread_fds_over(self) -> bool:
        """This client holds too many descriptors it was sent and has not read (alone, or with everyone
        else's past the server's share): it waits until it reads them (a look is scheduled)."""
        if not self.unread_fds:
            return False
        server = self.server
        if (
            self.unread_fds <= _MAX_UNREAD_FDS
            and server.state.fds_unread + server.out_fds <= server.max_out_fds
        ):
            return False
        if self._peer_read_all():
            return False
        self._look_later()
        return True

    def _peer_read_all(self) -> bool:
        """Whether the client has read every byte sent to it (then the descriptors it held are forgotten;
        so too where the socket cannot say, rather than holding the connection for good)."""
        if unread_by_peer(self.fd) > 0:
            return False
        self.forget_unread()
        self._look_wait = _UNREAD_LOOK_S[0]
        return True

    def forget_unread(self) -> None:
        """The descriptors the client held unread are read, or gone with its socket."""
        self.server.state.fds_unread -= self.unread_fds
        self.unread_fds = 0

    def _look_later(self) -> None:
        if self._look_timer is None and not self.closed:
            self._look_timer = self.server.loop.call_later(self._look_wait, self._look_again)
            self._look_wait = min(2 * self._look_wait, _UNREAD_LOOK_S[1])

    def _look_again(self) -> None:
        """Whether the client has read its descriptors (or the kernel takes more) yet: what waited goes on."""
        self._look_timer = None
        if self.closed:
            return
        self._peer_read_all()
        if self.refused_refs:
            self.refused_refs = False
            self._flush()
        self._run_next()  # (each of these asks first whether it may)
        self._resume_reading_if_room()

    def _protocol_error(self, exc: SkippydError) -> None:
        log.info("closing connection %d: %s", self.session.id, exc)
        self.server.state.protocol_errors += 1
        self._pause_reading()
        self.queue.clear()
        self.queued_bytes = 0
        self.decoder.close()  # (nothing more is read: what it buffered is dropped now, not at the close)
        self._account_partial(0)
        self._send(encode_frame(FrameType.ERROR, 0, exc.to_wire()), [])
        self.close_after_flush = True
        self._maybe_close()

    # ------------------------------------------------------------- running requests
    def _run_next(self) -> None:
        server = self.server
        state = server.state
        while not self.running and self.queue and not self.closed:
            if self._replies_backed_up():
                break  # it runs once the client has read its replies (_on_writable runs it)
            if self.copy is not None and not _names_half(self.queue[0].body):
                break  # it runs once this connection's copies have committed (_copied runs it)
            frame = self.queue.popleft()
            self.queued_bytes -= frame.size
            self._account_partial(self.decoder.buffered + self.queued_bytes)
            request_id, body = frame.request_id, frame.body
            staged = _names_half(body)
            try:
                if server.stopping:
                    raise ShuttingDown("the daemon is shutting down")
                op, handler, pooled = server.handlers.route(self.session, body)
            except Exception as exc:  # (a bug in routing too: answered, never an exception on the loop)
                if staged and self.copy is not None:
                    # the answer frees the other half, which the copy before may still read: it goes the
                    # way a staged reply goes (_finished holds it until that copy has ended)
                    self.running = True
                    state.inflight += 1
                    failed: Future[Reply] = Future()
                    failed.set_exception(exc)
                    self._finished(request_id, failed, staged=True)
                    return
                self._reply_failure(request_id, exc, "routing a request failed")
                continue
            state.ops[op] += 1
            started = time.perf_counter()
            session = self.session
            if pooled:
                work = functools.partial(_run_pooled, handler, session, body)
                self._submit(request_id, op, started, work, staged=staged)
                return
            try:
                reply = handler(session, body)
            except Exception as exc:
                self._reply_failure(request_id, exc, f"operation {op} failed")
            else:
                if isinstance(reply, Deferred):  # it needs the disk, or a put's copy, after all
                    if reply.park is not None:
                        self._park(request_id, op, started, reply)
                    else:
                        self._submit(request_id, op, started, functools.partial(_to_end, reply))
                    return
                self._reply(request_id, reply)
            state.latency.observe(op, time.perf_counter() - started)
        if not self.running and not self.reading:
            self._resume_reading_if_room()

    def _submit(
        self,
        request_id: int,
        op: str,
        started: float,
        work: Callable[[], Reply | Deferred],
        *,
        staged: bool = False,
    ) -> None:
        self.running = True
        self.server.state.inflight += 1
        future = self.server.pool.submit(work)
        future.add_done_callback(self._done_callback(request_id, op, started, staged))

    def _park(self, request_id: int, op: str, started: float, deferred: Deferred) -> None:
        """Runs ``deferred`` on a worker once its ``park`` wakes it (a put's copy it waits for committed)
        or :data:`SETTLE_SECONDS` have passed; meanwhile it holds no thread, only this connection (whose
        requests run in order)."""
        assert deferred.park is not None
        server = self.server
        self.running = True
        server.state.inflight += 1
        fired = False

        def go() -> None:  # on the event loop, once
            nonlocal fired
            if fired:
                return
            fired = True
            timer.cancel()
            forget()
            try:
                future = server.pool.submit(functools.partial(_to_end, Deferred(deferred.work)))
            except RuntimeError:  # the workers are gone: the daemon stops
                stopped: Future[Reply] = Future()
                stopped.set_exception(ShuttingDown("the daemon is shutting down"))
                self._finished(request_id, stopped)
                return
            future.add_done_callback(self._done_callback(request_id, op, started))

        def wake() -> None:  # any thread (the one that commits the copy, under the tier's lock)
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nothing waits any more)
                server.loop.call_soon_threadsafe(go)

        forget: Callable[[], None] = lambda: None  # noqa: E731 - replaced once parked
        timer = server.loop.call_later(SETTLE_SECONDS, go)
        try:
            forget = deferred.park(wake)
        except Exception as exc:  # (a bug: answered at once, never a request left hanging)
            fired = True
            timer.cancel()
            failed: Future[Reply] = Future()
            failed.set_exception(exc)
            self._finished(request_id, failed)

    def _done_callback(
        self, request_id: int, op: str, started: float, staged: bool = False
    ) -> Callable[[Future[Reply | Deferred]], None]:
        def done(future: Future[Reply | Deferred]) -> None:
            result = None if future.cancelled() or future.exception() is not None else future.result()
            if isinstance(result, Deferred):  # it must park: on the event loop, holding no thread
                self.server.loop.call_soon_threadsafe(self._repark, request_id, op, started, result)
                return
            self.server.state.latency.observe(op, time.perf_counter() - started)
            replied = cast("Future[Reply]", future)
            self.server.loop.call_soon_threadsafe(self._finished, request_id, replied, staged)

        return done

    def _repark(self, request_id: int, op: str, started: float, deferred: Deferred) -> None:
        """A request a worker ran that must now wait for a put's copy: parked as the event loop parks one."""
        self.running = False
        self.server.state.inflight -= 1
        if self.closed:
            self._ended_closed()
            return
        self._park(request_id, op, started, deferred)

    def _finished(self, request_id: int, future: Future[Reply], staged: bool = False) -> None:
        if staged and self.copy is not None:
            # The copy of the previous staged request still reads the other half: this reply (which
            # frees that half for the client) waits for it.
            self.held = functools.partial(self._finished, request_id, future, staged)
            return
        self.running = False
        self.server.state.inflight -= 1
        try:
            reply = future.result()
        except Exception as exc:
            self._reply_failure(request_id, exc, "a request failed")
        else:
            if reply.behind is not None:
                self._start_copy(reply.behind)
            if self.closed:
                _close_fds(reply.fds)
            else:
                self._reply(request_id, reply)
        if self.closed:
            self._ended_closed()
        else:
            self.server.maybe_stopped()
            self._run_next()

    def _ended_closed(self) -> None:
        """A request of a closed connection ended: its session goes once no copy reads its staging."""
        if self.copy is None:
            self.server.handlers.close_session(self.session)
        self.server.maybe_stopped()

    def _start_copy(self, behind: Behind) -> None:
        """Runs a put's copy and commit behind its reply, on the server's copy threads."""
        server = self.server
        try:
            future: Future[object] = server.copier.submit(behind.run)
        except RuntimeError:  # the copy threads are gone (the daemon stops): the put is not kept
            behind.abandon()
            return
        self.copy = future
        server.copying.add(self)
        server.state.copies_behind += 1
        future.add_done_callback(lambda done: server.loop.call_soon_threadsafe(self._copied, done))

    def _copied(self, future: Future[object]) -> None:
        self.server.state.copies_behind -= 1
        exc = future.exception()
        if exc is not None:
            self.server.state.errors += 1
            log.error("the copy behind a put's reply failed on connection %d", self.session.id, exc_info=exc)
        if self.copy is future:
            self.copy = None
            self.server.copying.discard(self)
        held, self.held = self.held, None
        if held is not None:
            held()
            return
        if self.closed and not self.running:
            self.server.handlers.close_session(self.session)
        self.server.maybe_stopped()
        self._run_next()

    def _resume_reading_if_room(self) -> None:
        if self._has_room():
            self._resume_reading()

    def _reply(self, request_id: int, reply: Reply) -> None:
        try:
            data = encode_frame(FrameType.REPLY, request_id, reply.body, len(reply.fds))
        except Exception as exc:
            _close_fds(reply.fds)
            self._reply_failure(request_id, exc, "could not encode a reply")
            return
        self._send(data, reply.fds)

    def _reply_failure(self, request_id: int, exc: Exception, what: str) -> None:
        """A typed error goes back as itself; the daemon out of descriptors is ``busy`` (it passes);
        anything else is a bug: logged, answered as internal."""
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            log.warning("%s: the daemon is out of file descriptors (%s)", what, exc)
            exc = Busy("the daemon is out of file descriptors; retry shortly")
        if not isinstance(exc, SkippydError):
            log.error("%s", what, exc_info=exc)
            exc = SkippydError(f"internal error: {type(exc).__name__}")
        self._reply_error(request_id, exc)

    def _reply_error(self, request_id: int, exc: SkippydError) -> None:
        self.server.state.errors += 1
        if isinstance(exc, VersionMismatch | PermissionDenied):
            self.close_after_flush = True
        self._send(encode_frame(FrameType.ERROR, request_id, exc.to_wire()), [])

    # ------------------------------------------------------------- writing
    def _send(self, data: bytes, fds: list[int]) -> None:
        if self.closed:
            _close_fds(fds)
            return
        if not self.out:  # the common case: the whole reply goes out now, nothing is queued
            try:
                sent = send_frame(self.sock, data, fds)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                if exc.errno != errno.ETOOMANYREFS:
                    _close_fds(fds)
                    self.close()
                    return
                sent = 0  # (queued: _flush below meets the refusal and looks again later)
            if sent:
                _close_fds(fds)  # the kernel holds them now, attached to the first byte sent
                self._sent_fds(len(fds))
                fds = []
                if sent == len(data):
                    if self.close_after_flush:
                        self._maybe_close()
                    return
                data = data[sent:]
        self.out.append((memoryview(data), fds))
        self.out_bytes += len(data)
        self.out_fds += len(fds)
        self.server.out_fds += len(fds)
        self._flush()

    def _flush(self) -> None:
        while self.out and not self.closed and not self.refused_refs:
            view, fds = self.out[0]
            try:
                sent = send_frame(self.sock, view, fds)  # type: ignore[arg-type]
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                if exc.errno != errno.ETOOMANYREFS:
                    self.close()
                    return
                self._refused_refs()
                break
            if sent == 0:
                break
            if fds:
                _close_fds(fds)  # the kernel holds them now, attached to the first byte sent
                self.out_fds -= len(fds)
                self.server.out_fds -= len(fds)
                self._sent_fds(len(fds))
            self.out_bytes -= sent
            if sent == len(view):
                self.out.popleft()
            else:
                self.out[0] = (view[sent:], [])
                break
        if self.out and not self.writing and not self.closed and not self.refused_refs:
            self.server.loop.add_writer(self.fd, self._on_writable)
            self.writing = True
        elif (not self.out or self.refused_refs) and self.writing:  # (a refusal: a timer looks again)
            self.server.loop.remove_writer(self.fd)
            self.writing = False
        self._maybe_close()
        if not self.out:
            self._resume_reading_if_room()

    def _sent_fds(self, count: int) -> None:
        self.unread_fds += count
        self.server.state.fds_unread += count

    def _refused_refs(self) -> None:
        """The kernel would not pass more descriptors (the daemon's user has its open-files limit of them
        in sockets no client has read): this reply waits, looked at again a few ms later, and the
        connection stays open."""
        self.refused_refs = True
        self.server.state.fd_refusals += 1
        now = time.monotonic()
        if now - self.server.refs_logged_at > 10.0:
            self.server.refs_logged_at = now
            log.warning(
                "the kernel refused to pass descriptors (ETOOMANYREFS: %d sent in replies clients have "
                "not read); replies wait until they read them",
                self.server.state.fds_unread,
            )
        self._look_later()

    def _on_writable(self) -> None:
        """The client reads again: send what waits, then run what its backed-up replies held back."""
        self._flush()
        self._run_next()  # (it asks first whether it may)

    def _maybe_close(self) -> None:
        if self.close_after_flush and not self.out and not self.running:
            self.close()

    # ------------------------------------------------------------- closing
    @property
    def idle(self) -> bool:
        return not self.running and not self.queue and not self.out and self.copy is None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pause_reading()
        if self.writing:
            self.server.loop.remove_writer(self.fd)
            self.writing = False
        for _view, fds in self.out:
            _close_fds(fds)
        self.out.clear()
        self.server.out_fds -= self.out_fds
        self.out_fds = 0
        if self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer = None
        self.queue.clear()
        self.queued_bytes = 0
        self._account_partial(0)
        self.decoder.close()
        # Descriptors the client was sent and has not read stay in its socket (counted against the
        # daemon's user) whatever the daemon does with its own end: the socket lingers, still counted
        # among its uid's connections, until the client reads them or closes (housekeeping looks).
        if self.unread_fds and not self._peer_read_all() and not self.server.stopping:
            self.server.linger(self)
        else:
            self.forget_unread()
            with contextlib.suppress(OSError):
                self.sock.close()
        self.server.forget(self, keep_uid=self.unread_fds > 0)
        if not self.running and self.copy is None:  # else once the copy reading its staging has ended
            self.server.handlers.close_session(self.session)


def _names_half(body: Any) -> bool:
    """A staged request that names its staging half (answered only once the copy before it has ended)."""
    if not isinstance(body, dict):
        return False
    op = body.get("op")  # (any msgpack value: a map or a list is unhashable)
    return isinstance(op, str) and op in STAGED_OPS and body.get("half") is not None


def _run_pooled(handler: Handler, session: Session, body: dict[str, Any]) -> Reply | Deferred:
    """How a handler runs on a worker thread: it, and its continuations, until there is a reply."""
    return _to_end(handler(session, body))


def _to_end(result: Reply | Deferred) -> Reply | Deferred:
    """Runs a handler's continuations (on a worker thread) until there is a reply, or a continuation that
    must park first (an inline request run on a worker because a tier's lock was held, that reached a
    put's copy): that one is handed back to the event loop, which parks it holding no thread (a worker
    waiting there would take a thread from every other request for up to SETTLE_SECONDS)."""
    while isinstance(result, Deferred):
        if result.park is not None:
            return result  # (the done callback parks it)
        result = result.work()
    return result


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Server:
    """Serves :class:`Handlers` on the configured Unix socket until told to stop."""

    def __init__(
        self,
        config: Config,
        handlers: Handlers,
        *,
        health: Health | None = None,
        state: ServerState | None = None,
        housekeeping: Callable[[], None] | None = None,
        before_forced_exit: Callable[[], None] | None = None,
    ) -> None:
        """``housekeeping`` runs on a worker thread every few seconds (the tiers' recency and trimming);
        ``before_forced_exit`` runs when a second signal ends the process at once."""
        self.config = config
        self.handlers = handlers
        self.health = health or Health()
        self.state = state or handlers.server
        self._housekeeping_job = housekeeping
        self._before_forced_exit = before_forced_exit
        self.pool = ThreadPoolExecutor(max_workers=config.worker_threads, thread_name_prefix="skippyd-worker")
        # the copies behind puts' replies (one at a time per connection); never cancelled: a stop runs
        # every one already started, so no acknowledged put is lost
        self.copier = ThreadPoolExecutor(
            max_workers=max(2, config.worker_threads), thread_name_prefix="skippyd-put-copy"
        )
        self.copying: set[Connection] = set()  # connections with a copy in flight (closed ones too)
        self.connections: dict[int, Connection] = {}
        self._per_uid: collections.Counter[int] = collections.Counter()
        self.partial_bytes = 0
        # descriptors held by replies no client has read yet, all connections together, and how many may
        # be before a connection holding some waits: a quarter of the open-files limit (at least 64)
        self.out_fds = 0
        self.lingering: list[Connection] = []  # closed, their sockets kept until their clients read or close
        self.refs_logged_at = -1e9
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_out_fds = max(64, (1 << 20 if soft == resource.RLIM_INFINITY else soft) // 4)
        self.stopping = False
        self._next_session = 0
        self._stopped: asyncio.Event | None = None
        self._signals = 0
        self._first_signal = 0.0
        self._published: PublishedSocket | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    # ------------------------------------------------------------- lifecycle
    async def serve(
        self, *, install_signals: bool = True, on_ready: Callable[[], None] | None = None
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        mode = self.config.socket_mode
        published = publish_socket(Path(self.config.socket), group=self.config.socket_group, mode=mode)
        if mode != 0o660:
            log.info(
                "socket mode %o: allowed_uids/allowed_gids decide who is served (peer credentials)", mode
            )
        self._published = published
        socket_gid = os.stat(published.path).st_gid
        self.policy = PeerPolicy(self.config, socket_gid)
        if install_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(signum, self._on_signal, signum)
        self.loop.add_reader(published.sock.fileno(), self._accept)
        tasks = [asyncio.create_task(self._housekeeping())]
        watchdog = watchdog_interval()
        if watchdog:
            tasks.append(asyncio.create_task(self._watchdog(watchdog)))
        log.info("serving on %s (node %s)", published.path, self.config.node_name)
        notify(f"READY=1\nSTATUS=serving on {published.path}\nMAINPID={os.getpid()}")
        if on_ready is not None:
            on_ready()
        try:
            await self._stopped.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if install_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self.loop.remove_signal_handler(signum)
            for conn in list(self.connections.values()):
                conn.close()
            self.bury_lingering(every=True)
            await self._copies_ended()
            self.copier.shutdown(wait=True)
            self.pool.shutdown(wait=True, cancel_futures=True)
            published.close()
            log.info("stopped")

    def request_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        notify("STOPPING=1")
        log.info("stopping: no new connections; finishing %d in-flight request(s)", self.state.inflight)
        if self._published is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self._published.sock.fileno())
            self._published.close()
        for conn in list(self.connections.values()):
            conn._pause_reading()
            if conn.idle:
                conn.close()
        if self._stopped is not None:
            self._stopped.set()

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        if self._signals and now - self._first_signal < _SAME_SIGNAL_S:
            return  # (one Ctrl-C that reached the daemon twice: a wrapper forwarding its group's SIGINT)
        self._signals += 1
        self._first_signal = self._first_signal or now
        if self._signals > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            if self._before_forced_exit is not None:
                with contextlib.suppress(Exception):
                    self._before_forced_exit()
            os._exit(128 + signum)
        self.request_stop()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.shutdown_timeout
        while time.monotonic() < deadline:
            busy = [c for c in self.connections.values() if not c.idle]
            if not busy:
                return
            await asyncio.sleep(0.02)
        log.warning(
            "shutdown timeout: abandoning %d busy connection(s)",
            sum(not c.idle for c in self.connections.values()),
        )

    async def _copies_ended(self) -> None:
        """Waits for every copy behind a reply (and the staged replies held for them, whose copies then
        start) to end: acknowledged puts are committed before the tiers close."""
        while self.copying:
            await asyncio.sleep(0.005)

    def shed_largest_buffers(self, reading: Connection) -> None:
        """While more request bytes are buffered than ``max_buffered``, closes the connection holding the
        most (``busy``), ``reading`` (the one that just read) last among equals."""
        limit = self.config.max_buffered
        while self.partial_bytes > limit:
            candidates = [c for c in self.connections.values() if c.partial and not c.close_after_flush]
            if not candidates:
                return
            hog = max(candidates, key=lambda c: (c.partial, c is not reading))
            hog._protocol_error(Busy("too many unfinished requests are buffered; retry shortly"))
            if hog is reading:
                return

    def maybe_stopped(self) -> None:
        if self.stopping:
            for conn in list(self.connections.values()):
                if conn.idle:
                    conn.close()

    # ------------------------------------------------------------- connections
    def _pause_accepting(self, seconds: float) -> None:
        """Stops accepting for ``seconds`` (new clients wait in the listen backlog meanwhile)."""
        published = self._published
        if published is None or self.stopping:
            return
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(published.sock.fileno())

        def resume() -> None:
            if self._published is published and not self.stopping:
                self.loop.add_reader(published.sock.fileno(), self._accept)

        self.loop.call_later(seconds, resume)

    def _accept(self) -> None:
        assert self._published is not None
        for _ in range(64):
            try:
                sock, _addr = self._published.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(_ACCEPT_PAUSE_S)  # (else the ready socket spins the loop)
                return
            sock.setblocking(False)
            self._next_session += 1
            session = Session(self._next_session)
            try:
                session.pid, session.uid, session.gid, groups = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            conn = Connection(self, sock, session)
            crowded = len(self.connections) + len(self.lingering) >= _MAX_CONNECTIONS
            if crowded or self._per_uid[session.uid] >= _MAX_CONNECTIONS_PER_UID:
                self.state.refused += 1
                message = (
                    "too many connections" if crowded else f"too many connections from uid {session.uid}"
                )
                conn._send(encode_frame(FrameType.ERROR, 0, {"code": "busy", "message": message}), [])
                conn.close()
                continue
            if not self.policy.allows(session.uid, session.gid, groups):
                self.state.refused += 1
                log.warning(
                    "refused a connection from pid %d uid %d gid %d", session.pid, session.uid, session.gid
                )
                error = PermissionDenied(f"uid {session.uid} is not allowed to use this daemon")
                self.connections[conn.fd] = conn
                self.state.connections = len(self.connections)
                conn.close_after_flush = True
                conn._send(encode_frame(FrameType.ERROR, 0, error.to_wire()), [])
                continue
            self.state.accepted += 1
            self.connections[conn.fd] = conn
            self.state.connections = len(self.connections)
            conn.counted = True
            self._per_uid[session.uid] += 1
            log.debug("connection %d from pid %d uid %d", session.id, session.pid, session.uid)
            conn.start()

    def forget(self, conn: Connection, *, keep_uid: bool = False) -> None:
        if self.connections.get(conn.fd) is conn:
            del self.connections[conn.fd]
            self.state.connections = len(self.connections)
        if conn.counted and not keep_uid:
            conn.counted = False
            self._per_uid[conn.session.uid] -= 1
            if self._per_uid[conn.session.uid] <= 0:
                del self._per_uid[conn.session.uid]

    def linger(self, conn: Connection) -> None:
        """Keeps a closed connection's socket (and its uid's count) while its client holds descriptors
        it has not read."""
        self.lingering.append(conn)
        self.state.lingering = len(self.lingering)

    def bury_lingering(self, *, every: bool = False) -> None:
        """Closes the lingering sockets whose clients have read everything or closed (``every``: all)."""
        kept: list[Connection] = []
        for conn in self.lingering:
            if not every and unread_by_peer(conn.fd) > 0:
                kept.append(conn)
                continue
            conn.forget_unread()
            self.forget(conn)  # (before the close: its fd number is not anyone else's yet)
            with contextlib.suppress(OSError):
                conn.sock.close()
        self.lingering = kept
        self.state.lingering = len(kept)

    # ------------------------------------------------------------- periodic work
    async def _housekeeping(self) -> None:
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if self.lingering:
                self.bury_lingering()
            for conn in list(self.connections.values()):
                if (
                    conn.decoder.mid_frame
                    and not conn.waiting_on_us
                    and now - conn.frame_started > self.config.frame_timeout
                ):
                    log.info("closing connection %d: a frame did not arrive in time", conn.session.id)
                    conn.close()
                elif (
                    self.config.idle_timeout
                    and conn.idle
                    and now - conn.last_activity > self.config.idle_timeout
                ):
                    conn.close()
            if now - last_flush >= 5.0 and self._housekeeping_job is not None:
                last_flush = now
                try:  # one failure never ends the housekeeping task
                    await self.loop.run_in_executor(self.pool, self._housekeeping_job)
                except Exception as exc:
                    self.health.failed("skippyd-housekeeping", "housekeeping failed", exc)

    async def _watchdog(self, interval: float) -> None:
        """Feeds systemd's watchdog while the event loop runs and every background thread lives; once one
        has died it stops, so systemd restarts the service (a daemon that cannot write L3 or talk to
        Redis any more is better restarted than left serving without saying so)."""
        while True:
            dead = self.health.dead()
            if dead:
                log.critical(
                    "background thread(s) %s died: no longer feeding the watchdog, systemd will restart "
                    "the daemon",
                    ", ".join(dead),
                )
                notify(f"STATUS=unhealthy: {', '.join(dead)} died")
                return
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)
