"""L3 recovery: rebuild what the store knows from what is on disk, and repair what a crash left.

Every file is written to ``tmp/``, fsynced and renamed into place (object first, then the manifest,
then the link), so a crash leaves either the old state or the new one plus leftovers. At start (and in
``skippyd l3 fsck``) :func:`scan`:

* removes everything in ``tmp/`` (writes cut short, evicted files ``l3.trash`` had not unlinked yet);
* removes whatever sits in ``objects/``, ``manifests/`` or ``links/`` that is not a real directory (a
  stray file, a symlink: only the link goes, its target is never followed);
* collects objects no manifest names, and files in ``objects/`` that are not objects;
* quarantines manifests that do not parse, fail their checksum, hold another key, or whose object is
  missing or has the wrong size;
* gives regions of earlier stores (named ``<digest>.obj``) their current name as a hard link;
* drops dangling links and restores missing ones.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippyd.errors import CorruptEntry
from skippyd.files import durable_dir, fsync_dir, remove
from skippyd.keys import is_hex_digest

from .layout import Layout
from .manifest import MAX_MANIFEST, Manifest, decode_manifest

__all__ = ["Found", "Reconciliation", "Scan", "scan"]


@dataclass
class Reconciliation:
    """What start-up (or ``skippyd l3 fsck``) found and did."""

    manifests: int = 0
    objects: int = 0
    temporary_removed: int = 0
    manifests_quarantined: int = 0
    objects_quarantined: int = 0
    dangling_links_dropped: int = 0
    links_restored: int = 0
    orphans_collected: int = 0
    objects_renamed: int = 0  # regions of earlier stores (named by digest alone) given their current name
    verified: int = 0
    blocks: int = 0  # live blocks found in packs
    blocks_verified: int = 0
    block_packs_quarantined: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, slots=True)
class Found:
    manifest: Manifest
    size: int  # of the manifest file
    last_use: int  # its mtime, ns


@dataclass
class Scan:
    objects: dict[str, int]  # object -> size, only those some manifest names
    found: list[Found]  # least recently used first
    report: Reconciliation


def scan(layout: Layout) -> Scan:
    """Reads the whole directory (its owner's lock held) and repairs it; see the module docstring."""
    report = Reconciliation()
    for child in layout.tmp.iterdir():
        remove(child)
        report.temporary_removed += 1
    objects: dict[str, int] = {}
    for shard in _subdirs(layout.objects, report):
        for obj in shard.iterdir():
            name = obj.name.removesuffix(".obj")
            if not obj.name.endswith(".obj") or not is_hex_digest(name) or obj.is_symlink():
                remove(obj)
                report.orphans_collected += 1
                continue
            objects[name] = obj.stat().st_size
    report.objects = len(objects)
    found: list[Found] = []
    for shard in _subdirs(layout.manifests, report):
        for path in shard.iterdir():
            try:
                found.append(_read_manifest(layout, path, objects, report))
            except (CorruptEntry, OSError) as exc:
                layout.quarantine_file(path, f"manifest {path.name}: {exc}")
                report.manifests_quarantined += 1
                report.problems.append(f"manifest {path.name}: {exc}")
    found.sort(key=lambda item: (item.last_use, item.manifest.entry.key))
    _repair_links(layout, found, report)
    named = {item.manifest.object for item in found}
    for name in [n for n in objects if n not in named]:
        remove(layout.object_path(name))
        del objects[name]
        report.orphans_collected += 1
    return Scan(objects, found, report)


def _subdirs(directory: Path, report: Reconciliation) -> list[Path]:
    """The real subdirectories of ``directory`` (its shards); anything else there is no part of the store
    and is removed: a file, or a symlink, whose link alone goes (never followed: repairing through one
    deleted or quarantined files outside the store)."""
    found: list[Path] = []
    for child in sorted(directory.iterdir()):
        if child.is_dir() and not child.is_symlink():
            found.append(child)
            continue
        remove(child)
        report.orphans_collected += 1
        report.problems.append(f"{directory.name}/{child.name} is no directory of the store: removed")
    return found


def _read_manifest(layout: Layout, path: Path, objects: dict[str, int], report: Reconciliation) -> Found:
    key = path.name.removesuffix(".man")
    if not path.name.endswith(".man") or not is_hex_digest(key) or path.is_symlink():
        raise CorruptEntry(f"unexpected file {path.name}")
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise CorruptEntry(f"{path.name} is not a regular file")
    raw = path.read_bytes() if st.st_size <= MAX_MANIFEST else b""
    manifest = decode_manifest(raw)
    entry = manifest.entry
    if entry.key != key:
        raise CorruptEntry("manifest holds another key")
    size = objects.get(manifest.object)
    if size is None and objects.get(entry.digest) == entry.data_len:
        size = _adopt_legacy_object(layout, manifest, objects)
        report.objects_renamed += 1
    if size is None:
        raise CorruptEntry("its object is missing")
    if size != entry.data_len:
        raise CorruptEntry("its object has the wrong size")
    return Found(manifest, st.st_size, st.st_mtime_ns)


def _adopt_legacy_object(layout: Layout, manifest: Manifest, objects: dict[str, int]) -> int:
    """Stores from before objects were named by digest *and* layout kept an entry's data region as
    ``<digest>.obj``: it gets its current name as a hard link (several layouts may have named that one
    file; loads verify every segment and the digest against each manifest, so a region written for
    another layout is caught there). The old name, named by no manifest now, is collected with the
    orphans."""
    old = layout.object_path(manifest.entry.digest)
    new = layout.object_path(manifest.object)
    durable_dir(new.parent)
    os.link(old, new)
    fsync_dir(new.parent)
    objects[manifest.object] = objects[manifest.entry.digest]
    return objects[manifest.object]


def _repair_links(layout: Layout, found: list[Found], report: Reconciliation) -> None:
    wanted = {
        layout.link_path(
            item.manifest.entry.identity, item.manifest.entry.token_count, item.manifest.entry.key
        )
        for item in found
    }
    for ident_dir in _subdirs(layout.links, report):
        for link in ident_dir.iterdir():
            if link not in wanted or link.is_symlink() or not link.is_file():
                remove(link)
                report.dangling_links_dropped += 1
        if not any(ident_dir.iterdir()):
            ident_dir.rmdir()
    for path in wanted:
        if not path.is_file():
            layout.write_link(path)
            report.links_restored += 1
