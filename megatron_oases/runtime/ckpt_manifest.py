"""A checkpoint's checksum manifest: written at the end of a save, checked before a load starts.

Why: a file garbled in place (same size, other bytes: a bad disk block, a copy gone wrong) passes
every structural check of ``checkpoint.check_checkpoint_files`` and fails only inside
``dist_checkpointing.load``, after the process groups and the model exist, on some ranks, with a
traceback that names neither the file nor a way out. Each file's size and digest, recorded when
the save completes and compared in the launcher before any process group, turn that into one line.

The format is Megatron-Core's integrity manifest (megatron-core 0.17 on:
``dist_checkpointing.save(..., verify_integrity=True)``, Megatron-LM's ``--verify-integrity``):
``iter_N/integrity.json`` holding ``{"algorithm": "sha256", "files": {name: hex digest}}``, here
with ``"sizes"`` added (Megatron ignores it; a size is checked without reading the file). So
Megatron-LM with ``--verify-integrity`` verifies our checkpoints and we verify its. SHA-256 is
Megatron's choice; with the SHA extensions of current CPUs it is also faster than blake2b
(docs/checkpoints.md: measured).

This module reads and writes files only; ``checkpoint.py`` decides when, and words the errors.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

MANIFEST = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME (0.17 on)
ALGORITHM = "sha256"
_CHUNK = 8 << 20
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch_dist's writer: __RANK_N.distcp


def file_digest(path: str) -> str:
    """SHA-256 of the file, streamed (hashlib releases the GIL: threads hash files in parallel)."""
    h = hashlib.new(ALGORITHM)
    with open(path, "rb", buffering=0) as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _sizes_and_digests(directory: str, names: list[str]) -> dict[str, tuple[int, str]]:
    def one(name):
        path = os.path.join(directory, name)
        return name, (os.path.getsize(path), file_digest(path))

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
        return dict(pool.map(one, names))


def _owner(name: str, world_size: int) -> int:
    """The rank that wrote a shard file (its data is still in that node's page cache); rank 0
    hashes the rest (metadata, common state)."""
    m = _SHARD.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world_size else 0


def write_manifest(directory: str) -> None:
    """Collective, after every rank's files in ``directory`` are written: each rank hashes the
    shard files it wrote, rank 0 the others, and rank 0 writes the manifest. ``directory`` is the
    save's temporary one, so the manifest appears with the checkpoint, at its rename."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    names = [sorted(e.name for e in os.scandir(directory) if e.is_file() and e.name != MANIFEST)
             if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)  # rank 0's listing: one view of a shared file system
    mine = [n for n in names[0] if _owner(n, world) == rank]
    parts = [None] * world if rank == 0 else None
    dist.gather_object(_sizes_and_digests(directory, mine), parts, dst=0)
    if rank != 0:
        return
    entries = {k: v for part in parts for k, v in part.items()}
    payload = {"algorithm": ALGORITHM, "files": {k: d for k, (_, d) in sorted(entries.items())},
               "sizes": {k: s for k, (s, _) in sorted(entries.items())}}
    tmp = os.path.join(directory, f"{MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def has_manifest(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, MANIFEST))


def first_mismatch(directory: str) -> tuple[str, str] | None:
    """``(file, what differs)`` for the first file of ``directory`` (by name) that differs from
    its manifest, the manifest itself when it is unreadable; None when all match. Sizes are
    compared first (no reading), then digests, hashed in parallel threads. The manifest must
    exist (``has_manifest``)."""
    manifest = os.path.join(directory, MANIFEST)
    try:
        with open(manifest, encoding="utf-8") as f:
            data = json.load(f)
        digests, sizes = dict(data["files"]), dict(data.get("sizes", {}))
        algorithm = data.get("algorithm", ALGORITHM)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return manifest, "is unreadable or not a checksum manifest"
    if algorithm != ALGORITHM:
        return manifest, f"names the digest {algorithm!r}; only {ALGORITHM} is known"
    for name in sorted(digests):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return path, f"is missing ({MANIFEST} lists it)"
        if name in sizes and os.path.getsize(path) != sizes[name]:
            return path, (f"is {os.path.getsize(path)} bytes, {sizes[name]} when it was saved "
                          f"({MANIFEST})")
    got = _sizes_and_digests(directory, sorted(digests))
    for name in sorted(digests):
        if got[name][1] != digests[name]:
            return os.path.join(directory, name), (
                f"has changed since it was saved (its {ALGORITHM} is not the one in {MANIFEST}: "
                "same size, other bytes)")
    return None
