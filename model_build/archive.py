"""Pack model.tar.gz deterministically: the same files always give the same archive sha256.

Members sit at the archive root in sorted order with fixed metadata (mtime 0, uid/gid 0, no
owner names, mode 0644), and the gzip header carries neither a file name nor a time, so the
archive hash depends only on member names and contents; that is what makes the upload
idempotent and the artifact reproducible. Files are streamed (never read whole) and hashed
as they are packed, so the caller can prove the packed bytes are the ones it validated.
gzip level 0 (stored blocks): quantised GGUF weights barely compress (SmolLM2 Q4_1: level 1
saves 5.7 % but packs at 33 MB/s on a 2-core host, level 0 at 450 MB/s), and SageMaker
unpacks the archive on every instance start, where inflating real deflate blocks costs more
time than downloading the few percent it saved.
Only regular files with plain names are packed: a name with a path separator or `..`, or a
symlink or other non-regular file, is refused, so unpacking can never write outside
`/opt/ml/model` or follow a link.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from model_build.errors import BuildError

GZIP_LEVEL = 0


@dataclass(frozen=True)
class ArchiveDigest:
    """Size and sha256 of the written archive, and the sha256 of each packed member."""

    size: int
    sha256: str
    members: dict[str, str]


def write_archive(members: Sequence[tuple[str, Path]], out: BinaryIO) -> ArchiveDigest:
    """Write a tar.gz of `(name in archive, file on disk)` pairs to `out`."""
    names = [name for name, _ in members]
    for name in names:
        _check_member_name(name)
    if len(set(names)) != len(names):
        raise BuildError(f"refusing to pack duplicate member names: {sorted(names)}")
    sink = _HashingWriter(out)
    member_sha256: dict[str, str] = {}
    with (
        gzip.GzipFile(
            filename="", mode="wb", fileobj=sink, compresslevel=GZIP_LEVEL, mtime=0
        ) as compressed,
        tarfile.TarFile(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, path in sorted(members):
            with _open_regular(path) as handle:
                info = tarfile.TarInfo(name)
                info.size = os.fstat(handle.fileno()).st_size
                info.mode = 0o644
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                reader = _HashingReader(handle)
                tar.addfile(info, reader)
                member_sha256[name] = reader.digest.hexdigest()
    return ArchiveDigest(size=sink.size, sha256=sink.digest.hexdigest(), members=member_sha256)


def _check_member_name(name: str) -> None:
    if (
        not name
        or name in {".", ".."}
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.startswith("-")
    ):
        raise BuildError(f"refusing to pack {name!r}: members must be plain names at the root")


def _open_regular(path: Path) -> BinaryIO:
    """Open without following a final symlink, and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BuildError(f"refusing to pack {path}: it is a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BuildError(f"refusing to pack {path}: not a regular file")
    return os.fdopen(fd, "rb")


class _HashingWriter:
    """Pass-through writer that hashes and counts what reaches the output file."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self.digest.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self._out.flush()


class _HashingReader:
    """Pass-through reader that hashes what tarfile copies into the archive."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self.digest.update(data)
        return data
