"""Kernel cache: in memory and on disk (``~/.cache/ssmc`` or ``SSMC_CACHE_DIR``).

Keys are complete: `cache_key` hashes every part that decides the bytes (rendered source,
arch, target name and version, compiler version, ssmc version, flags). Writes are atomic
(temp file + rename), each entry carries a SHA-256 of its payload, and a corrupt or truncated
entry is treated as missing and rebuilt, never trusted. A read-only or unusable cache
directory degrades to memory only (`writable` says so). Two processes writing one key both
succeed: the rename is atomic and both write the same bytes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("ssmc")
_MAGIC = b"SSMC1"


def cache_key(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


class KernelCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self.mem: dict[tuple[str, str], bytes] = {}
        self.hits = self.misses = 0
        self.writable = True
        self.events: list[str] = []       # what happened, for ssmc.explain
        self._lock = threading.Lock()

    def _path(self, key: str, name: str) -> Path:
        return self.root / key[:2] / key / name

    def get(self, key: str, name: str) -> bytes | None:
        with self._lock:
            if (key, name) in self.mem:
                self.hits += 1
                return self.mem[(key, name)]
        p = self._path(key, name)
        try:
            raw = p.read_bytes()
        except OSError:
            self.misses += 1
            return None
        data = _unwrap(raw)
        if data is None:
            self.events.append(f"corrupt cache entry {p} ignored and rebuilt")
            log.warning("ssmc: corrupt cache entry %s ignored; rebuilding", p)
            try:
                p.unlink()
            except OSError:
                pass
            self.misses += 1
            return None
        with self._lock:
            self.mem[(key, name)] = data
            self.hits += 1
        return data

    def put(self, key: str, name: str, data: bytes) -> Path | None:
        with self._lock:
            self.mem[(key, name)] = data
        if not self.writable:
            return None
        p = self._path(key, name)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_wrap(data))
            os.replace(tmp, p)
            return p
        except OSError as e:
            self.writable = False
            self.events.append(f"cache directory {self.root} is not writable ({e}); caching in memory only")
            log.warning("ssmc: cache directory %s not writable (%s); memory only", self.root, e)
            return None

    def path_of(self, key: str, name: str) -> Path:
        return self._path(key, name)


def _wrap(data: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(data).digest() + len(data).to_bytes(8, "little") + data


def _unwrap(raw: bytes) -> bytes | None:
    if len(raw) < len(_MAGIC) + 40 or not raw.startswith(_MAGIC):
        return None
    o = len(_MAGIC)
    digest, n = raw[o:o + 32], int.from_bytes(raw[o + 32:o + 40], "little")
    data = raw[o + 40:]
    if len(data) != n or hashlib.sha256(data).digest() != digest:
        return None
    return data


_CACHES: dict[str, KernelCache] = {}


def get_cache(root: str) -> KernelCache:
    """One cache object per directory, shared by every target in the process."""
    root = str(Path(root).expanduser())
    if root not in _CACHES:
        _CACHES[root] = KernelCache(root)
    return _CACHES[root]
