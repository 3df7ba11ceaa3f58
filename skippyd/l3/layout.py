"""The L3 directory on disk: where each file lives, and how a file gets there whole.

    <l3_dir>/                        0700; files 0600
      .lock                          owner lock (flock), the owner's pid inside
      objects/<o[:2]>/<object>.obj   one data region, shared by every manifest with the same bytes+layout
      manifests/<k[:2]>/<key>.man    one entry's manifest (:mod:`.manifest`); its mtime is the last use
      links/<identity>/<count>.<key> which token counts an identity has (rebuilt when missing)
      packs/<ns>-<rand>.pack         blocks, one immutable pack per group commit (:mod:`.packs`)
      packs/<ns>-<rand>.dead         the indexes of a pack's records that were removed since
      quarantine/<ns>-<name>         files that failed verification, with <ns>-<name>.why: the reason
      tmp/                           writes in progress

Every path is built from names the daemon computed (hex digests, counts), never from client text.
A file is written to ``tmp/``, fsynced, renamed into place and its directory fsynced, so a crash never
leaves a torn file under a real name.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from skippyd.files import durable_dir, fsync_dir, private_dirs

__all__ = ["Layout"]

_WRITE_STEP = 64 << 20


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def links(self) -> Path:
        return self.root / "links"

    @property
    def packs(self) -> Path:
        return self.root / "packs"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def create(self) -> None:
        private_dirs(
            self.root, self.objects, self.manifests, self.links, self.packs, self.quarantine_dir, self.tmp
        )

    def object_path(self, name: str) -> Path:
        return self.objects / name[:2] / f"{name}.obj"

    def manifest_path(self, key: str) -> Path:
        return self.manifests / key[:2] / f"{key}.man"

    def link_path(self, identity: str, token_count: int, key: str) -> Path:
        return self.links / identity / f"{token_count}.{key}"

    # ------------------------------------------------------------------ writing whole files
    def write_file(self, final: Path, data: memoryview) -> None:
        """tmp + write + fsync + rename + directory fsync: the file appears whole or not at all."""
        os.rename(self.stage_file(final, data), final)
        fsync_dir(final.parent)

    def stage_file(self, final: Path, data: memoryview) -> Path:
        """Writes and fsyncs ``data`` to a temporary file for ``final``; returns its path."""
        durable_dir(final.parent)
        temp = self.tmp / f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        view = memoryview(data).cast("B")
        try:
            written = 0
            while written < len(view):
                with view[written : written + _WRITE_STEP] as part:
                    written += os.pwrite(fd, part, written)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            raise
        finally:
            # No view of the caller's memory may outlive this call, even when a traceback keeps this frame:
            # the caller could not unmap that memory afterwards (BufferError).
            view.release()
        os.close(fd)
        return temp

    def write_link(self, path: Path) -> None:
        durable_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        fsync_dir(path.parent)

    # ------------------------------------------------------------------ quarantine
    def quarantine_file(self, path: Path, reason: str) -> tuple[str, int]:
        """Moves ``path`` into quarantine with a note of why; returns the name it got there and the bytes
        now held there for it (0 when the file was already gone)."""
        stamp = f"{time.time_ns()}-{path.name}"
        target = self.quarantine_dir / stamp
        try:
            size = path.stat().st_size
            os.rename(path, target)
        except OSError:
            return stamp, 0
        note = self.quarantine_dir / f"{stamp}.why"
        text = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {path.name}: {reason}\n"
        with contextlib.suppress(OSError):
            note.write_text(text)
            size += len(text)
        return stamp, size

    def quarantined(self) -> list[tuple[Path, int]]:
        """Quarantined files (notes included), oldest first, with their sizes."""
        found = []
        for path in self.quarantine_dir.iterdir():
            with contextlib.suppress(OSError):
                found.append((path, path.stat().st_size))
        return sorted(found, key=lambda item: item[0].name)
