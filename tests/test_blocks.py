"""Blocks over a real daemon: chained keys, dedup, leading runs, isolation, leases, eviction, restarts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemonutil import DaemonProcess, eventually

import skippyd
from skippyd.client import blockspace
from skippyd.errors import InvalidArgument, TooLarge

MODEL, STATE = "block-model@sha256:0", "paged-kv-v1"
BLOCK = 16
BLOCK_BYTES = 64 * 1024


def block_data(count: int, seed: int, nbytes: int = BLOCK_BYTES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def space(client: skippyd.Client, **overrides: Any) -> skippyd.BlockSpace:
    args = {"model": MODEL, "state": STATE, "namespace": "", "block_tokens": BLOCK, **overrides}
    return client.blocks(**args)


def test_a_second_turn_stores_only_its_new_blocks(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        turn1 = list(range(5 * BLOCK + 3))  # 5 whole blocks and a partial one
        turn2 = turn1 + list(range(1000, 1000 + 3 * BLOCK))
        keys1, keys2 = blocks.keys(turn1), blocks.keys(turn2)
        assert len(keys1) == 5 and len(keys2) == 8 and keys2[:5] == keys1
        assert all(len(key) == 32 for key in keys2)
        data = block_data(8, seed=1)
        first = blocks.put(keys1, data[:5])
        assert (first.stored, first.present, first.nbytes) == (5, 0, 5 * BLOCK_BYTES)
        second = blocks.put(keys2, data)
        assert (second.stored, second.present, second.nbytes) == (3, 5, 3 * BLOCK_BYTES)
        stats = client.stats()
        assert stats["l2"]["block_count"] == 8
        assert stats["l2"]["block_bytes"] == 8 * BLOCK_BYTES
        assert stats["ops"]["block_bytes_offered"] == 13 * BLOCK_BYTES
        assert stats["ops"]["block_bytes_written"] == 8 * BLOCK_BYTES
        got = blocks.get(keys2)
        assert [bytes(t.numpy()) for t in got] == [bytes(t.numpy()) for t in data]


def test_contains_counts_the_leading_run_and_stops_at_a_hole(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(6 * BLOCK)))
        data = block_data(6, seed=2)
        blocks.put(keys[:3], data[:3])
        blocks.put(keys[4:], data[4:], parent=keys[3])  # its parent is not held: a hole before it
        assert blocks.contains(keys) == 3
        assert blocks.contains(keys[:2]) == 2
        assert blocks.contains([]) == 0
        assert blocks.contains([b"other", *keys]) == 0
        assert len(blocks.get(keys)) == 3
        out = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(6)]
        assert blocks.get_into(keys, out) == 3
        assert all(torch.equal(out[i], data[i]) for i in range(3))
        assert not out[3].any()


@pytest.mark.parametrize("op", ["blocks_get", "blocks_contains", "blocks_put"])
def test_the_daemon_names_a_bad_key_a_raw_request_sends_and_the_connection_goes_on(
    daemon: DaemonProcess, op: str
) -> None:
    """What the client checks before sending, the daemon checks again where it binds the keys (a client
    in another language, or a buggy one, gets one clear ``invalid_argument``, never ``internal``)."""
    with daemon.client() as client:
        conn = client._connection()
        base = {"op": op, "model": MODEL, "state": STATE, "namespace": "", "block_tokens": BLOCK}
        for keys, named in (([b"ok", 7, b"x"], "block key 1"), ([b"ok", b"y", bytes(65)], "block key 2"),
                            ([b"", b"ok"], "block key 0")):  # fmt: skip
            more = {"sizes": [1] * len(keys), "offsets": [-1] * len(keys)} if op == "blocks_put" else {}
            with pytest.raises(InvalidArgument, match=f"{named} must be 1 to 64 bytes"):
                conn.request({**base, "keys": keys, **more}, 5.0)
        assert client.ping()
        assert space(client).contains([b"ok"]) == 0


def test_engine_keys_of_1_and_64_bytes_work_and_0_or_65_are_refused(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = [b"\x01", bytes(range(64))]
        data = block_data(2, seed=3, nbytes=4096)
        assert blocks.put(keys, data).stored == 2
        assert blocks.contains(keys) == 2
        for bad in (b"", bytes(65)):
            with pytest.raises(InvalidArgument, match="1 to 64"):
                blocks.contains([bad])
            with pytest.raises(InvalidArgument, match="1 to 64"):
                blocks.put([bad], data[:1])
        for bad in (b"", bytes(65)):  # the daemon checks for itself what this library refused already
            with pytest.raises(InvalidArgument, match="1 to 64"):
                client._call(
                    {
                        "op": "blocks_contains",
                        "model": MODEL,
                        "state": STATE,
                        "block_tokens": BLOCK,
                        "keys": [bad],
                    }
                )
    assert "Traceback" not in daemon.log_text()


def test_a_block_size_no_block_may_have_is_refused_even_for_a_held_block(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(BLOCK)))
        blocks.put(keys, block_data(1, seed=3, nbytes=4096))
        base = {"op": "blocks_put", "model": MODEL, "state": STATE, "block_tokens": BLOCK, "keys": keys}
        for size in (2**63, (64 << 20) + 1):  # not sent (offset -1): the block is held, its size a lie
            with pytest.raises(TooLarge, match="larger than a block may be"):
                client._call({**base, "sizes": [size], "offsets": [-1]})
        stats = client.stats()  # the lie was counted nowhere: the counters still encode
        assert stats["ops"]["block_bytes_offered"] == 4096
    assert "Traceback" not in daemon.log_text()


def test_the_same_key_in_another_model_state_namespace_or_block_size_is_another_block(
    daemon: DaemonProcess,
) -> None:
    with daemon.client() as client:
        base = space(client)
        key = [b"engine-block-hash-0"]
        base.put(key, block_data(1, seed=4))
        for other in (
            {"model": "another-model"},
            {"state": "another-layout"},
            {"namespace": "tenant-b"},
            {"block_tokens": 32},
        ):
            assert space(client, **other).contains(key) == 0, other
        assert base.contains(key) == 1
        tokens = list(range(2 * BLOCK))
        assert space(client, namespace="tenant-b").keys(tokens) != base.keys(tokens)


def test_a_held_block_never_changes_under_a_reader_or_a_later_put(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(2 * BLOCK)))
        original = block_data(2, seed=5)
        blocks.put(keys, original)
        again = blocks.put(keys, block_data(2, seed=6))  # other bytes for the same keys: left as they are
        assert (again.stored, again.present) == (0, 2)
        views = blocks.get(keys)
        views[0].fill_(0)  # a private copy-on-write mapping: the store never sees this
        fresh = blocks.get(keys)
        assert torch.equal(fresh[0], original[0]) and torch.equal(fresh[1], original[1])
        assert not views[0].any()


def test_a_leased_slot_is_not_reused_until_its_reader_lets_go(make_daemon: Any) -> None:
    proc = make_daemon(budget="4MiB").start()
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(BLOCK)))
        original = block_data(1, seed=7)
        blocks.put(keys, original)
        held = blocks.get(keys)[0]
        client.evict(model=MODEL, state=STATE, blocks=True)
        assert blocks.contains(keys) == 0
        # fill the tier many times over: the leased slot must keep its bytes while we hold the view
        for round_ in range(8):
            more = blocks.keys(list(range(10_000 * (round_ + 1), 10_000 * (round_ + 1) + 16 * BLOCK)))
            blocks.put(more, block_data(16, seed=100 + round_), durable=False)
        assert torch.equal(held, original[0])
        assert client.stats()["l2"]["block_slab_bytes"] <= 4 << 20


def test_get_into_copies_through_a_kept_slab_mapping_and_a_reused_slot_gives_its_new_bytes(
    make_daemon: Any,
) -> None:
    from skippyd.client.blockspace import slab_maps

    slab_maps.close()
    # with the reserve on: a slot it is faulting in (or a free slot the digester still reads) holds budget
    # this tier, filled to the brim, needs; a put waits for it instead of failing no_space (test_l2_reserve)
    proc = make_daemon(budget="2MiB").start()
    with proc.client() as client:
        blocks = space(client)
        first = blocks.keys(list(range(8 * BLOCK)))
        data = block_data(8, seed=31)
        blocks.put(first, data, durable=False)
        out = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in first]
        assert blocks.get_into(first, out) == 8
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))
        kept = len(slab_maps)
        assert kept >= 1  # the slab is mapped once and kept for the next call
        # the tier fills many times over: the slots the first blocks had now hold other blocks' bytes
        for round_ in range(4):
            more = blocks.keys(list(range(10_000 * (round_ + 1), 10_000 * (round_ + 1) + 24 * BLOCK)))
            newer = block_data(24, seed=40 + round_)
            blocks.put(more, newer, durable=False)
            got = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in more]
            count = blocks.get_into(more, got)
            assert count == blocks.contains(more) > 0
            assert all(torch.equal(a, b) for a, b in zip(got[:count], newer[:count], strict=True))
        assert blocks.get_into(first, out) == blocks.contains(first)
        assert len(slab_maps) <= slab_maps.limit


def test_a_kept_slab_mapping_holds_no_lease_so_evicted_slots_are_taken_again_at_once(
    make_daemon: Any,
) -> None:
    from skippyd.client.blockspace import slab_maps

    slab_maps.close()
    # (no reserve faulting slots in, no digester leasing them: every put hashes its blocks before its reply)
    proc = make_daemon("--l2-reserve", "0", "--l2-digest-backlog", "0", budget="64MiB").start()
    with proc.client() as client:
        blocks = space(client)
        first = blocks.keys(list(range(8 * BLOCK)))
        blocks.put(first, block_data(8, seed=51), durable=False)
        out = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in first]
        assert blocks.get_into(first, out) == 8
        assert len(slab_maps) >= 1  # the slab stays mapped in this process
        fresh = client.stats()["l2"]["block_fresh_slots"]
        client.evict(model=MODEL, state=STATE, blocks=True)
        second = blocks.keys(list(range(50_000, 50_000 + 8 * BLOCK)))
        newer = block_data(8, seed=52)
        assert blocks.put(second, newer, durable=False).stored == 8
        # the eight freed slots were taken again (a mapping of the get's own descriptor kept its leases:
        # they counted as still read, and the put faulted in eight fresh slots beside them)
        assert client.stats()["l2"]["block_fresh_slots"] == fresh
        got = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in second]
        assert blocks.get_into(second, got) == 8
        assert all(torch.equal(a, b) for a, b in zip(got, newer, strict=True))


_NOBODY = 65534
_ALLOWED_GID = 4242  # a gid no file names, for the client allowed by it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("allowed_by", ["socket_group", "allowed_uids", "allowed_gids"])
def test_a_client_of_another_user_allowed_by_group_uid_or_gid_keeps_its_slab_mappings_without_leases(
    make_daemon: Any, allowed_by: str
) -> None:
    """The daemon's files are 0640 in the socket's group, with a POSIX ACL giving read to
    ``allowed_uids``/``allowed_gids``, so a client of another user allowed any of these ways can open a
    descriptor it was handed again: it keeps the slab mapped across calls through a description of its
    own (no lease held: evicted slots are taken again at once). With 0600 files (or no ACL) it could not,
    and read every block through the reply's descriptor on every call."""
    import grp
    import signal
    import stat
    import time

    try:
        nogroup = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("needs the group nogroup (Debian's; nobody's group elsewhere)")
    if allowed_by == "socket_group":
        flags, groups = ["--socket-group", "nogroup"], [nogroup]
    elif allowed_by == "allowed_uids":
        flags, groups = ["--allowed-uids", str(_NOBODY)], [_ALLOWED_GID + 1]  # (a group nothing names)
    else:
        flags, groups = ["--allowed-gids", str(_ALLOWED_GID)], [_ALLOWED_GID]
    proc = make_daemon(*flags, "--l2-reserve", "0", "--l2-digest-backlog", "0", budget="64MiB").start()
    for parent in (proc.socket.parent, proc.socket.parent.parent):
        os.chmod(parent, 0o711)
    data = block_data(8, seed=71)
    with proc.client() as client:
        blocks = space(client, namespace="other-user")
        first = blocks.keys(list(range(8 * BLOCK)))
        blocks.put(first, data, durable=False)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the engine: another user, allowed only the one way
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setgid(groups[0])
            os.setuid(_NOBODY)
            from skippyd.client.blockspace import slab_maps

            slab_maps.close()
            try:
                with skippyd.Client(proc.socket, timeout=10.0) as other:
                    mine = space(other, namespace="other-user")
                    out = [bytearray(BLOCK_BYTES) for _ in first]
                    count = mine.get_into(first, out)
                    right = all(bytes(o) == bytes(d.numpy()) for o, d in zip(out, data, strict=True))
                    code = f"{count} {int(right)} {len(slab_maps)}".encode()
            except Exception as exc:
                code = f"{type(exc).__name__}: {exc}".encode()[:200]
            os.write(write_end, code)
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    outcome = os.read(read_end, 300).decode()
    os.close(read_end)
    assert outcome == "8 1 1", outcome  # all 8 blocks, right, through one kept mapping of the slab
    slabs = list((proc.shm_dir / "blocks").iterdir())
    assert slabs
    for slab in slabs:
        info = slab.stat()
        assert stat.S_IMODE(info.st_mode) == 0o640, slab
        assert info.st_gid == (nogroup if allowed_by == "socket_group" else os.getegid()), slab


def _acl_ids(path: Path) -> set[tuple[str, int]]:
    """The named users and groups of ``path``'s POSIX ACL (empty: none)."""
    import struct

    try:
        raw = os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return set()
    named = {0x02: "user", 0x08: "group"}
    entries = [struct.unpack_from("<HHI", raw, at) for at in range(4, len(raw), 8)]
    return {(named[tag], ident) for tag, perm, ident in entries if tag in named and perm == 4}


def test_allowed_ids_read_the_files_through_an_acl_that_a_daemon_without_them_takes_off_at_adoption(
    make_daemon: Any,
) -> None:
    proc = make_daemon("--allowed-uids", "65534,0", "--allowed-gids", "4242", budget="64MiB").start()
    with proc.client() as client:
        blocks = space(client, namespace="acl")
        blocks.put(blocks.keys(list(range(4 * BLOCK))), block_data(4, seed=5), durable=False)
        client.capture(model="m", state="s", tokens=[1, 2, 3], tensors={"x": torch.ones(4096)})
    files = [*(proc.shm_dir / "blocks").iterdir(), *(proc.shm_dir / "entries").iterdir()]
    assert len(files) >= 2
    for path in files:
        assert _acl_ids(path) == {("user", 65534), ("user", 0), ("group", 4242)}, path
    proc.stop()
    proc.args = [a for a in proc.args if a not in ("--allowed-uids", "65534,0", "--allowed-gids", "4242")]
    proc.start()  # adopts both files: the ids it no longer names lose their read
    with proc.client() as client:
        assert client.restore(model="m", state="s", tokens=[1, 2, 3]) is not None
    for path in files:
        assert path.exists() and _acl_ids(path) == set(), path


def test_get_into_copies_through_the_replys_descriptor_where_no_mapping_can_be_made(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import mmap
    from types import SimpleNamespace

    from skippyd.client import transfer
    from skippyd.client.blockspace import slab_maps

    with daemon.client() as client:
        blocks = space(client, namespace="no-mapping")
        keys = blocks.keys(list(range(6 * BLOCK)))
        data = block_data(6, seed=61)
        blocks.put(keys, data, durable=False)
        slab_maps.close()
        tried: list[int] = []

        def no_room(*args: Any, **kwargs: Any) -> mmap.mmap:
            tried.append(1)
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        fake = SimpleNamespace(mmap=no_room, MAP_SHARED=mmap.MAP_SHARED, PROT_READ=mmap.PROT_READ)
        monkeypatch.setattr(transfer, "mmap", fake)  # (vm.max_map_count reached, say)
        out = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in keys]
        open_before = len(os.listdir("/proc/self/fd"))
        assert blocks.get_into(keys, out) == 6
        assert tried and len(slab_maps) == 0
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))
        assert len(os.listdir("/proc/self/fd")) <= open_before  # (the failed tries left no descriptor open)


def test_slab_maps_keep_slab_files_only_and_drop_one_whose_file_is_gone(shm_dir: Path) -> None:
    import os

    from skippyd.client.blockspace import SlabMaps

    maps = SlabMaps(limit=2)
    paths = [shm_dir / f"slab-{i}" for i in range(4)]
    fds = []
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i + 1]) * 8192)
        fds.append(os.open(path, os.O_RDONLY))
    memfd = os.memfd_create("not-a-slab")
    try:
        os.write(memfd, b"x" * 8192)
        assert maps.view(memfd, 8192) is None  # an L3 read's memfd: read, never kept
        assert maps.view(fds[0], 8193) is None  # shorter than the blocks it should hold: read instead
        view = maps.view(fds[0], 8192)
        assert view is not None and bytes(view[:2]) == b"\x01\x01"
        view.release()
        assert len(maps) == 1
        paths[0].unlink()  # the slab is removed (a wiped directory): unmapped at the next call
        again = maps.view(fds[1], 4096)
        assert again is not None and bytes(again[:1]) == b"\x02"
        again.release()
        assert len(maps) == 1
        for fd in fds[1:]:
            got = maps.view(fd, 4096)
            assert got is not None
            got.release()
        assert len(maps) == 2  # three live slabs, a limit of two: the least recently used is unmapped
    finally:
        maps.close()
        assert len(maps) == 0
        for fd in [*fds, memfd]:
            os.close(fd)


def test_eviction_takes_a_chain_from_its_tail(make_daemon: Any) -> None:
    proc = make_daemon(budget="2MiB").start()
    with proc.client() as client:
        blocks = space(client)
        chain = blocks.keys(list(range(8 * BLOCK)))
        blocks.put(chain, block_data(8, seed=8), durable=False)  # L2 alone: what it evicts is gone
        before = blocks.contains(chain)
        assert before == 8
        # a second, newer chain that needs room: the first one loses blocks from its end only
        other = blocks.keys(list(range(50_000, 50_000 + 26 * BLOCK)))  # 34 blocks of 64 KiB > 2 MiB
        blocks.put(other, block_data(26, seed=9), durable=False)
        held = blocks.contains(chain)
        assert 0 < held < 8
        stats = client.stats()["l2"]
        # every block still in memory is reachable: nothing beyond a chain's first missing block is kept
        reachable = held + blocks.contains(other)
        assert stats["block_count"] == reachable


def test_blocks_survive_a_daemon_restart_verified(make_daemon: Any) -> None:
    proc = make_daemon().start()
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(4 * BLOCK)))
        data = block_data(4, seed=10)
        blocks.put(keys, data, durable=False)
    assert proc.stop() == 0
    proc.start()
    with proc.client() as client:
        blocks = space(client)
        assert blocks.contains(keys) == 4
        assert client.stats()["l2"]["block_adopted"] == 4
        assert all(torch.equal(a, b) for a, b in zip(blocks.get(keys), data, strict=True))


def test_puts_of_buffers_any_dtype_and_get_into_buffers(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = [b"k0", b"k1", b"k2"]
        as_bf16 = torch.randn(1024, dtype=torch.bfloat16)
        data: list[Any] = [as_bf16, np.arange(512, dtype=np.int32), bytearray(b"x" * 100)]
        assert blocks.put(keys, data).stored == 3
        out: list[Any] = [bytearray(2048), np.zeros(2048, dtype=np.uint8), bytearray(100)]
        assert blocks.get_into(keys, out) == 3
        assert bytes(out[0]) == as_bf16.view(torch.uint8).numpy().tobytes()
        assert out[1].tobytes() == np.arange(512, dtype=np.int32).tobytes()
        assert bytes(out[2]) == b"x" * 100
        with pytest.raises(skippyd.Mismatch):
            blocks.get_into(keys[:1], [bytearray(10)])


def test_a_block_may_be_a_list_of_pieces_strided_tensors_included(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(2 * BLOCK)))
        kv = torch.randn(1, 4, 2 * BLOCK, 8)  # [batch, heads, tokens, dim]: a block's slice is strided
        halves = [kv[..., i * BLOCK : (i + 1) * BLOCK, :] for i in range(2)]
        assert not halves[0].is_contiguous()
        tail = np.arange(10, dtype=np.uint8)
        put = blocks.put(keys, [[halves[0], tail], (halves[1], halves[1].to(torch.float16))])
        sizes = [halves[0].numel() * 4 + 10, halves[1].numel() * 6]
        assert (put.stored, put.nbytes) == (2, sum(sizes))
        got = blocks.get(keys)
        assert [len(t) for t in got] == sizes
        assert bytes(got[0].numpy()) == halves[0].contiguous().numpy().tobytes() + tail.tobytes()
        second = halves[1].contiguous()
        assert bytes(got[1].numpy()) == second.numpy().tobytes() + second.to(torch.float16).numpy().tobytes()


def test_get_into_scatters_a_block_over_a_list_of_pieces_and_refuses_pieces_too_small(
    daemon: DaemonProcess,
) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(2 * BLOCK)))
        data = block_data(2, seed=7)
        assert blocks.put(keys, data).stored == 2
        # a page spread over layers, as an engine's layer-first pool holds it: K and V rows of each layer
        pool = torch.zeros(2, 4, 2, BLOCK_BYTES // 8, dtype=torch.uint8)  # [K/V, layer, page, bytes]
        pieces = [[pool[kv, layer, page] for layer in range(4) for kv in range(2)] for page in range(2)]
        assert blocks.get_into(keys, pieces) == 2
        for page in range(2):
            joined = torch.cat([p.reshape(-1) for p in pieces[page]])
            assert torch.equal(joined, data[page].reshape(-1).view(torch.uint8))
        over = [bytearray(BLOCK_BYTES // 2), bytearray(BLOCK_BYTES)]  # more room than needed: filled in order
        assert blocks.get_into(keys[:1], [over]) == 1
        assert bytes(over[0]) + bytes(over[1][: BLOCK_BYTES // 2]) == data[0].numpy().tobytes()
        assert not any(over[1][BLOCK_BYTES // 2 :])
        with pytest.raises(skippyd.Mismatch):
            blocks.get_into(keys[:1], [[bytearray(BLOCK_BYTES // 2), bytearray(10)]])


def test_async_block_calls_match_the_blocking_ones(daemon: DaemonProcess) -> None:
    async def main() -> tuple[int, int, list[bytes]]:
        async with skippyd.AsyncClient(daemon.socket) as client:
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
            keys = blocks.keys(list(range(3 * BLOCK)))
            put = await blocks.put(keys, block_data(3, seed=11))
            held = await blocks.contains(keys)
            got = await blocks.get(keys)
            out = [bytearray(BLOCK_BYTES) for _ in keys]
            assert await blocks.get_into(keys, out) == 3
            assert [bytes(b) for b in out] == [bytes(t.numpy()) for t in got]
            return put.stored, held, [bytes(t.numpy()) for t in got]

    stored, held, got = asyncio.run(main())
    assert (stored, held) == (3, 3)
    assert got == [bytes(t.numpy()) for t in block_data(3, seed=11)]
    with daemon.client() as client:
        assert space(client).contains(space(client).keys(list(range(3 * BLOCK)))) == 3


def test_a_get_longer_than_one_reply_comes_back_whole(make_daemon: Any) -> None:
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = space(client)
        # 9 spaces' worth of slabs would exceed the descriptors of one reply; one space with small slabs
        # too: 600 blocks of 64 KiB are 3 slabs of 256 slots
        keys = blocks.keys(list(range(600 * BLOCK)))
        data = block_data(600, seed=12)
        assert blocks.put(keys, data).stored == 600
        got = blocks.get(keys)
        assert len(got) == 600 and torch.equal(got[599], data[599])


def _block_gets(client: skippyd.Client) -> int:
    return int(client.stats()["ops"]["block_gets"])


def test_a_long_get_into_asks_for_the_next_blocks_before_it_copies_the_ones_in_hand(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon leases the next blocks while the client copies these: while the first reply's blocks
    are being read, the daemon has served a second blocks_get already (blocking and async clients)."""
    proc = make_daemon(budget="64MiB").start()
    real = blockspace._read_blocks
    seen: list[int] = []

    with proc.client() as client, proc.client() as observer:
        blocks = space(client)
        keys = blocks.keys(list(range(200 * BLOCK)))
        data = block_data(200, seed=14)
        assert blocks.put(keys, data).stored == 200
        start = _block_gets(observer)

        def reading(reply: dict[str, Any], fds: list[int], out: Any, first: int) -> int:
            if first == 0:  # the first reply in hand: the next request is served without waiting for it
                seen.append(eventually(lambda: _block_gets(observer) - start >= 2, timeout=5))
            return real(reply, fds, out, first)

        monkeypatch.setattr(blockspace, "_read_blocks", reading)
        out = [bytearray(BLOCK_BYTES) for _ in keys]
        assert blocks.get_into(keys, out) == 200
        assert [bytes(b) for b in out] == [t.numpy().tobytes() for t in data]

        async def run_async() -> int:
            async with skippyd.AsyncClient(proc.socket) as aclient:
                ablocks = aclient.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
                again = [bytearray(BLOCK_BYTES) for _ in keys]
                count = await ablocks.get_into(keys, again)
                assert again == out
                return count

        start = _block_gets(observer)
        assert asyncio.run(run_async()) == 200
    assert seen == [True, True]


def test_a_get_into_that_fails_midway_leaves_the_client_usable_and_holds_no_lease(
    make_daemon: Any,
) -> None:
    """A destination too small for a block of a later reply: Mismatch, and the request sent ahead is read
    and its descriptors closed (no descriptor left open, the client's next calls answered)."""
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(300 * BLOCK)))
        assert blocks.put(keys, block_data(300, seed=16)).stored == 300
        out: list[Any] = [bytearray(BLOCK_BYTES) for _ in keys]
        assert blocks.get_into(keys, out) == 300  # (the slab mappings the client keeps are made)
        fds = len(os.listdir("/proc/self/fd"))
        out[100] = bytearray(10)  # in the second reply; the third was asked for before it is read
        with pytest.raises(skippyd.Mismatch):
            blocks.get_into(keys, out)
        assert len(os.listdir("/proc/self/fd")) == fds
        assert blocks.contains(keys) == 300
        out[100] = bytearray(BLOCK_BYTES)
        assert blocks.get_into(keys, out) == 300

        async def run_async() -> None:
            async with skippyd.AsyncClient(proc.socket) as aclient:
                ablocks = aclient.blocks(model=MODEL, state=STATE, block_tokens=BLOCK)
                bad: list[Any] = [bytearray(BLOCK_BYTES) for _ in keys]
                bad[100] = bytearray(10)
                with pytest.raises(skippyd.Mismatch):
                    await ablocks.get_into(keys, bad)
                assert await ablocks.get_into(keys, out) == 300

        before = len(os.listdir("/proc/self/fd"))
        asyncio.run(run_async())
        assert eventually(lambda: len(os.listdir("/proc/self/fd")) == before, timeout=5)


def test_ls_summarises_blocks_per_identity_and_evict_drops_one_identitys_blocks(
    daemon: DaemonProcess,
) -> None:
    import json
    import subprocess
    import sys

    with daemon.client() as client:
        space(client).put([b"a", b"b"], block_data(2, seed=13, nbytes=4096), durable=False)
        space(client, model="second-model").put([b"a"], block_data(1, seed=14, nbytes=4096), durable=False)

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "skippyd", *args, "--socket", str(daemon.socket)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout

    summary = json.loads(cli("ls", "--blocks", "--json"))
    assert sorted((row["l2_blocks"], row["l2_bytes"]) for row in summary) == [(1, 4096), (2, 8192)]
    assert "BLOCKS OF" in cli("ls")
    status = cli("status")
    assert "0 entries, 3 blocks, " in status  # the blocks' memory counts in what status says L2 holds
    assert "removed 2 blocks" in cli("evict", "--blocks", "--model", MODEL, "--state", STATE)
    with daemon.client() as client:
        assert space(client).contains([b"a"]) == 0
        assert space(client, model="second-model").contains([b"a"]) == 1


def test_the_reserve_faults_slots_in_ahead_of_demand_and_gives_them_back_first(make_daemon: Any) -> None:
    from daemonutil import eventually

    proc = make_daemon("--l2-reserve", "2MiB", budget="16MiB").start()
    with proc.client() as client:
        blocks = space(client)
        blocks.put([f"first{i}".encode() for i in range(8)], block_data(8, seed=15), durable=False)
        # what the last seconds of puts took is kept ready for the next ones
        assert eventually(lambda: client.stats()["l2"]["block_free_slots"] >= 8, timeout=10)
        fresh = client.stats()["l2"]["block_fresh_slots"]
        blocks.put([f"k{i}".encode() for i in range(8)], block_data(8, seed=16), durable=False)
        assert client.stats()["l2"]["block_fresh_slots"] == fresh  # every slot came from the reserve
        # entries that need the whole budget get it: the reserve is the first memory given back
        tensor = torch.zeros(15 << 20 >> 2, dtype=torch.float32)
        client.capture(model=MODEL, state=STATE, tokens=[1, 2, 3], tensors={"kv": tensor}, durable=False)
        assert client.lookup(model=MODEL, state=STATE, tokens=[1, 2, 3]) is not None


def test_the_reserve_gives_its_memory_back_a_window_after_puts_stop(make_daemon: Any) -> None:
    from daemonutil import eventually

    proc = make_daemon("--l2-reserve", "2MiB", "--l2-reserve-window", "2s", budget="16MiB").start()
    with proc.client() as client:
        space(client).put([f"k{i}".encode() for i in range(8)], block_data(8, seed=17), durable=False)
        assert eventually(lambda: client.stats()["l2"]["block_free_slots"] >= 8, timeout=10)
        assert eventually(lambda: client.stats()["l2"]["block_free_slots"] == 0, timeout=10)
        stats = client.stats()["l2"]
        assert stats["reserve_given_back"] >= 8 * BLOCK_BYTES and stats["block_count"] == 8


def test_the_reserve_keeps_a_pre_faulted_file_for_the_next_capture_of_a_size_it_saw(make_daemon: Any) -> None:
    from daemonutil import eventually

    proc = make_daemon("--l2-reserve", "16MiB", budget="64MiB").start()
    with proc.client() as client:
        tensor = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
        client.capture(model=MODEL, state=STATE, tokens=[1], tensors={"kv": tensor}, durable=False)
        eventually(lambda: client.stats()["l2"]["prefaulted_files"] >= 1, timeout=10)
        before = client.stats()["l2"]
        client.capture(model=MODEL, state=STATE, tokens=[2], tensors={"kv": tensor * 2}, durable=False)
        after = client.stats()["l2"]
        assert after["fresh_files"] == before["fresh_files"]  # no capture faulted pages in itself
        assert after["reused_files"] == before["reused_files"] + 1
        restored = client.restore(model=MODEL, state=STATE, tokens=[2])
        assert restored is not None and torch.equal(restored.tensors["kv"], tensor * 2)


def test_a_restart_keeps_a_chains_tail_first_eviction_order(make_daemon: Any) -> None:
    proc = make_daemon(budget="2MiB").start()
    with proc.client() as client:
        blocks = space(client)
        chain = blocks.keys(list(range(8 * BLOCK)))
        blocks.put(chain, block_data(8, seed=17), durable=False)
    assert proc.stop() == 0
    proc.start()
    with proc.client() as client:
        blocks = space(client)
        assert blocks.contains(chain) == 8
        other = blocks.keys(list(range(70_000, 70_000 + 26 * BLOCK)))
        blocks.put(other, block_data(26, seed=18), durable=False)
        held = blocks.contains(chain)
        assert 0 < held < 8  # the adopted chain lost blocks from its end, not its head
        assert client.stats()["l2"]["block_count"] == held + blocks.contains(other)


def test_a_get_leaves_the_chains_head_newest_across_a_restart(make_daemon: Any) -> None:
    proc = make_daemon(budget="2MiB").start()
    with proc.client() as client:
        blocks = space(client)
        chain = blocks.keys(list(range(8 * BLOCK)))
        data = block_data(8, seed=19)
        blocks.put(chain[:4], data[:4], durable=False)
        blocks.put(chain[4:], data[4:], durable=False, parent=chain[3])  # the tail is the newest now
        assert len(blocks.get(chain)) == 8  # ... and the head after the get, its order kept in the records
    assert proc.stop() == 0
    proc.start()
    with proc.client() as client:
        blocks = space(client)
        other = blocks.keys(list(range(70_000, 70_000 + 26 * BLOCK)))
        blocks.put(other, block_data(26, seed=20), durable=False)
        assert 0 < blocks.contains(chain) < 8  # the chain lost blocks from its end, not its head


def _copy_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many memcpys each get_into's host copy makes (the runs after merging)."""
    from skippyd.client import blockspace

    counts: list[int] = []
    original = blockspace._memmoves

    def spy(copies: list[Any]) -> None:
        counts.append(len(copies))
        original(copies)

    monkeypatch.setattr(blockspace, "_memmoves", spy)
    return counts


def test_get_into_a_vllm_paged_layout_is_bit_exact_and_copies_each_run_of_consecutive_pages_once(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from paged import vllm_block, vllm_caches

    layers, heads = 4, 2  # a page piece is 16 tokens × 2 heads × 128 × bf16 = 8 KiB; a block 1 MiB
    source = vllm_caches(layers, 64, heads, seed=1)
    engine = vllm_caches(layers, 80, heads)
    held = [list(range(16 * b, 16 * (b + 1))) for b in range(3)]
    into = [
        list(range(32, 48)),
        list(range(79, 63, -1)),
        [1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14],
    ]
    proc = make_daemon(budget="64MiB").start()
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(3 * 256)))
        put = blocks.put(keys, [vllm_block(source, pages) for pages in held], durable=False)
        assert (put.stored, put.nbytes) == (3, 3 << 20)
        runs = _copy_runs(monkeypatch)
        assert blocks.get_into(keys, [vllm_block(engine, pages) for pages in into]) == 3
    for layer in range(layers):
        for kv in range(2):
            for b in range(3):
                for src, dst in zip(held[b], into[b], strict=True):
                    assert torch.equal(
                        engine[layer][kv, dst].view(torch.uint8), source[layer][kv, src].view(torch.uint8)
                    )
            untouched = sorted(set(range(80)) - {p for pages in into for p in pages})
            assert not engine[layer][kv, untouched].view(torch.uint8).any()
    # block 0's 16 pages are consecutive: one memcpy per layer and K/V; the others' pages are not adjacent
    assert sum(runs) == layers * 2 + 2 * layers * 2 * 16  # (in chunks of 4 MiB over two threads)


def test_get_into_an_sglang_layer_first_pool_is_bit_exact_blocking_and_async(make_daemon: Any) -> None:
    from paged import sglang_block, sglang_pool

    source = sglang_pool(3, 1024, 2, seed=2)
    held = [[0, 1, 2, 3], [4, 5, 6, 7]]
    proc = make_daemon(budget="64MiB").start()

    def check(pool: torch.Tensor, into: list[list[int]]) -> None:
        for b in range(2):
            for src, dst in zip(held[b], into[b], strict=True):
                got = pool[:, :, dst * 64 : (dst + 1) * 64]
                assert torch.equal(
                    got.view(torch.uint8), source[:, :, src * 64 : (src + 1) * 64].view(torch.uint8)
                )

    into = [[9, 10, 11, 12], [3, 2, 1, 0]]
    with proc.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        keys = blocks.keys(list(range(2 * 256)))
        assert blocks.put(keys, [sglang_block(source, pages) for pages in held], durable=False).stored == 2
        pool = sglang_pool(3, 1024, 2)
        assert blocks.get_into(keys, [sglang_block(pool, pages) for pages in into]) == 2
        check(pool, into)

    async def main() -> torch.Tensor:
        async with skippyd.AsyncClient(proc.socket) as client:
            blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
            pool = sglang_pool(3, 1024, 2)
            pieces = [sglang_block(pool, pages) for pages in into]
            assert await blocks.get_into(blocks.keys(list(range(2 * 256))), pieces) == 2
            return pool

    check(asyncio.run(main()), into)


def test_get_into_strided_pieces_gets_their_elements_in_the_order_put_stored_them(
    daemon: DaemonProcess,
) -> None:
    from paged import hf_block, hf_layers, random_like

    with daemon.client() as client:
        blocks = client.blocks(model=MODEL, state=STATE, block_tokens=256)
        # HF dynamic-cache layers (batch, heads, tokens, dim): a block's slice of one is a strided view
        source = hf_layers(2, 512, seed=0)
        keys = blocks.keys(list(range(2 * 256)))
        assert blocks.put(keys, [hf_block(source, b) for b in range(2)], durable=False).stored == 2
        engine = hf_layers(2, 512)
        pieces = [hf_block(engine, b) for b in range(2)]
        assert not pieces[0][0].is_contiguous()
        assert blocks.get_into(keys, pieces) == 2
        assert all(
            torch.equal(e.view(torch.uint8), s.view(torch.uint8))
            for pe, ps in zip(engine, source, strict=True)
            for e, s in zip(pe, ps, strict=True)
        )
        # a strided piece at an odd byte of its block, a transposed one, a conjugate view
        odd = random_like((16, 8), torch.float32, 7).t()
        cplx = random_like((4, 8), torch.complex64, 8)
        other = blocks.keys([9] * 256)
        assert blocks.put(other, [[bytearray(b"abc"), odd, cplx.conj()]], durable=False).stored == 1
        head, got_odd, got_cplx = (
            bytearray(3),
            torch.zeros(16, 8, dtype=torch.float32),
            torch.zeros(4, 8, dtype=torch.complex64),
        )
        assert blocks.get_into(other, [[head, got_odd.t(), got_cplx.conj()]]) == 1
        assert head == b"abc"
        assert torch.equal(got_odd.t().contiguous().view(torch.uint8), odd.contiguous().view(torch.uint8))
        assert torch.equal(got_cplx.view(torch.uint8), cplx.view(torch.uint8))  # conj stored, conj read back
        # a strided piece the block fills only in part: its first elements in logical order, the rest kept
        short = blocks.keys([8] * 256)
        values = torch.arange(16, dtype=torch.float32)
        assert blocks.put(short, [values], durable=False).stored == 1
        target = torch.full((8, 4), -1.0)
        assert blocks.get_into(short, [target.t()]) == 1
        assert torch.equal(target.t().reshape(-1), torch.cat([values, torch.full((16,), -1.0)]))
        # refused with a typed error, nothing written: a strided numpy array, a piece with a 0 stride
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            blocks.get_into(short, [np.zeros((16, 8), dtype=np.uint8)[:, ::2]])
        with pytest.raises(InvalidArgument, match="0 stride"):
            blocks.get_into(short, [torch.zeros(1, dtype=torch.float32).expand(16)])


def test_get_into_the_rows_of_a_2d_tensor_or_array_fills_each_row_with_its_block(
    daemon: DaemonProcess,
) -> None:
    with daemon.client() as client:
        blocks = space(client)
        keys = [b"r0", b"r1", b"r2"]
        data = block_data(3, seed=7, nbytes=4096)
        assert blocks.put(keys, data).stored == 3
        rows = torch.zeros((3, 4096), dtype=torch.uint8)
        assert blocks.get_into(keys, rows) == 3
        assert all(torch.equal(rows[i], data[i]) for i in range(3))
        array = np.zeros((3, 4096), dtype=np.uint8)
        assert blocks.get_into(keys, array) == 3
        assert all(array[i].tobytes() == data[i].numpy().tobytes() for i in range(3))


def test_a_get_across_many_slabs_is_one_reply_where_the_client_takes_many_descriptors(
    make_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skippyd.errors import InvalidArgument as Invalid
    from skippyd.protocol import DEFAULT_REPLY_FDS, MAX_FDS

    proc = make_daemon("--l2-reserve", "0", budget="32MiB").start()  # slabs of 2 MiB: 2 blocks each
    with proc.client() as client:
        blocks = space(client)
        keys = blocks.keys(list(range(20 * BLOCK)))
        data = block_data(20, seed=41, nbytes=1 << 20)
        blocks.put(keys, data, durable=False)
        reply, fds = client._call(blocks._body("blocks_get", keys))  # a client from before max_fds
        for fd in fds:
            os.close(fd)
        assert len(fds) == DEFAULT_REPLY_FDS and len(reply["blocks"]) == 2 * DEFAULT_REPLY_FDS
        reply, fds = client._call(blocks._body("blocks_get", keys, max_fds=MAX_FDS))
        for fd in fds:
            os.close(fd)
        assert len(fds) == 10 and len(reply["blocks"]) == 20, "every slab in one reply"
        for bad in (0, 7, MAX_FDS + 1, "8", True):  # (below 8: a run partly from L3 brings up to 5)
            with pytest.raises(Invalid, match="max_fds"):
                client._call(blocks._body("blocks_get", keys, max_fds=bad))
        asked: list[str] = []
        real = blockspace.BlockSpace._body

        def body(self: Any, op: str, keys: list[bytes], **more: Any) -> dict[str, Any]:
            asked.append(op)
            return real(self, op, keys, **more)

        monkeypatch.setattr(blockspace.BlockSpace, "_body", body)
        out = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(20)]
        assert blocks.get_into(keys, out) == 20
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))
        assert asked.count("blocks_get") == 1, "the client asks for up to 64 descriptors a reply"
