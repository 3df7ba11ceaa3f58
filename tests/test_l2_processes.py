"""Two real processes over one tmpfs tier: zero-copy reads, copy-on-write, and leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from l2util import IDENT, key_of, size_of

from skippyd.client import tensors as skt
from skippyd.l2 import L2Tier

READER = textwrap.dedent(
    """
    import fcntl, json, os, sys, torch
    from blake3 import blake3
    from skippyd.l2 import L2Tier
    from skippyd.payload import decode_fixed, decode_header
    from skippyd.client.tensors import map_entry
    from skippyd.shm import open_reader

    path = sys.argv[1]
    fd = open_reader(path)
    fixed = decode_fixed(os.pread(fd, 64, 0))
    header = decode_header(fixed, os.pread(fd, fixed.header_len, 64))
    tensors = map_entry(fd, fixed.data_offset, header.data_len, header.tensors)
    os.close(fd)  # the mapping alone keeps the lease

    def digest():
        h = blake3()
        for spec in header.tensors:
            h.update(tensors[spec.name].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def copied_kb():
        # pages copied on write become anonymous; pages read stay the tmpfs file's own pages
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                inside = path in line
            elif inside and line.startswith("Anonymous:"):
                total += int(parts[1])
        return total

    storages = {t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}
    print(json.dumps({"digest": digest(), "storages": len(storages), "copied_kb": copied_kb()}), flush=True)
    for command in sys.stdin:
        command = command.strip()
        if command == "write":
            for t in tensors.values():
                if t.numel():
                    t.view(-1)[0] = 0 if t.dtype == torch.bool else 42
            print(json.dumps({"digest": digest(), "copied_kb": copied_kb()}), flush=True)
        elif command == "digest":
            print(json.dumps({"digest": digest()}), flush=True)
        elif command == "quit":
            break
    """
)


def _start_reader(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ask(proc: subprocess.Popen[str], command: str | None = None) -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    if command is not None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, "reader process died"
    result: dict[str, object] = json.loads(line)
    return result


def _admit_tensors(tier: L2Tier, name: str, tensors: dict[str, torch.Tensor]) -> str:
    decls = skt.declare(tensors)
    with tier.reserve(key=key_of(name), identity=IDENT, token_count=len(name), tensors=decls) as res:
        skt.write_into(res.data, res.tensors, tensors)
        return res.commit().digest


def test_another_process_reads_tensors_bit_exact_from_shared_pages_without_copying(shm_dir: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "k": torch.randn(64, 1024),
        "v": torch.randn(64, 1024, dtype=torch.float64).to(torch.bfloat16),
        "mask": torch.rand(333) > 0.5,
        "ids": torch.randint(-(2**62), 2**62, (77,)),
    }
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        digest = _admit_tensors(tier, "a", tensors)
        reader = _start_reader(shm_dir / "entries" / f"{key_of('a')}.skp")
        try:
            first = _ask(reader)
            assert first["digest"] == digest
            assert first["storages"] == 1, "every tensor is a view of one shared mapping"
            assert first["copied_kb"] == 0, "reading copied no page into the reader's private memory"
        finally:
            _ask_quit(reader)


def _ask_quit(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    except BrokenPipeError:
        pass
    proc.wait(timeout=30)


def test_writing_to_restored_tensors_never_alters_the_entry(shm_dir: Path) -> None:
    tensors = {"k": torch.arange(50000, dtype=torch.float32), "b": torch.ones(10, dtype=torch.bool)}
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        digest = _admit_tensors(tier, "a", tensors)
        path = shm_dir / "entries" / f"{key_of('a')}.skp"
        writer = _start_reader(path)
        try:
            _ask(writer)
            after_write = _ask(writer, "write")
            assert after_write["digest"] != digest, "the writer sees its own writes"
            assert int(str(after_write["copied_kb"])) > 0, "the write landed in a private copy"
            other = _start_reader(path)
            try:
                assert _ask(other)["digest"] == digest, "nobody else does"
            finally:
                _ask_quit(other)
        finally:
            _ask_quit(writer)
        held = tier.hold(key_of("a"), hit=False)
        assert held is not None
        restored = skt.map_entry(held.fd, held.data_offset, held.entry.data_len, held.entry.tensors)
        os.close(held.fd)
        assert torch.equal(restored["k"], tensors["k"]) and torch.equal(restored["b"], tensors["b"])


def test_an_entry_evicted_while_a_reader_holds_it_never_changes_under_the_reader(shm_dir: Path) -> None:
    one = size_of(1 << 20)
    payload = {"x": torch.full((1 << 20,), 5, dtype=torch.uint8)}
    with L2Tier.open(shm_dir, one) as tier:  # room for exactly one entry
        digest = _admit_tensors(tier, "held", payload)
        reader = _start_reader(shm_dir / "entries" / f"{key_of('held')}.skp")
        try:
            assert _ask(reader)["digest"] == digest
            # Same size class: without the lease this would rewrite the reader's pages in place.
            _admit_tensors(tier, "next", {"x": torch.full((1 << 20,), 9, dtype=torch.uint8)})
            stats = tier.stats()
            assert tier.peek(key_of("held")) is None
            assert stats.reader_held_drops == 1 and stats.reused_files == 0
            assert _ask(reader, "digest")["digest"] == digest
        finally:
            _ask_quit(reader)
        # Nobody reads "next": its file is recycled for the following entry.
        _admit_tensors(tier, "third", {"x": torch.full((1 << 20,), 3, dtype=torch.uint8)})
        assert tier.stats().reused_files == 1


def test_a_reader_exiting_leaves_the_entry_in_place(shm_dir: Path) -> None:
    """Unlike multiprocessing.shared_memory on 3.11, no resource tracker unlinks what a reader attached."""
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        digest = _admit_tensors(tier, "a", {"x": torch.arange(1000)})
        path = shm_dir / "entries" / f"{key_of('a')}.skp"
        for _ in range(2):
            reader = _start_reader(path)
            assert _ask(reader)["digest"] == digest
            _ask_quit(reader)
        assert path.exists()
        assert tier.peek(key_of("a")) is not None
    with L2Tier.open(shm_dir, 64 << 20) as tier:
        assert tier.stats().adopted == 1
