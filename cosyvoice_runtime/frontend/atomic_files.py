"""Crash-safe file replacement for the voice store: readers see the old content or all of the new
one, also on NFS (a rename or a hard link inside one directory is atomic there)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

TMP_SUFFIX = ".tmp"  # of the temp files a crash can leave behind (the store's gc removes them)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms/file systems cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or all of the new one.

    ``exclusive``: fail with ``FileExistsError`` if ``path`` exists (the temp file is hard-linked,
    which is atomic and refuses an existing name, instead of renamed over it).
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after link: the second name; after replace: already gone
    fsync_dir(path.parent)


def probe_writable(directory: Path) -> str | None:
    """None when a file can be created and removed in ``directory``; else why not (the OS's words).

    The probe file is a dot file with the temp suffix: never listed, and collected by the store's gc
    if a crash leaves it behind."""
    probe = Path(directory) / f".write-check.{uuid.uuid4().hex}{TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None
