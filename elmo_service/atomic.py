"""Atomic file and folder writes: readers see the old content or the new, never half.

Every write goes to a temporary sibling (``.<name>.<random>.tmp``, same folder, so
the rename cannot cross file systems), is flushed and fsync'ed, renamed over the
target with :func:`os.replace`, and the folder is fsync'ed so the rename itself
survives a power cut. A failure removes the temporary and leaves the target as it
was. Every file committed gets the permissions a plain ``open()`` would give it
(0666 less the umask), whoever wrote it: ``mkstemp`` and some writers (safetensors'
``save_file``) make their files 0600, which another user could not read.

* :func:`write_bytes`, :func:`write_text`, :func:`write_json`: whole contents at once;
* :func:`atomic_open`: a file object, for writers that stream (``torch.save``, ``np.save``);
* :func:`atomic_path`: a temporary path, for writers that want a file name
  (h5py, safetensors' ``save_file``);
* :func:`atomic_dir`: a whole folder, built in a temporary sibling and swapped in
  (one ``renameat2(RENAME_EXCHANGE)`` on Linux: the folder never goes missing).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def process_umask() -> int:
    """This process's umask, read without changing it (Linux); else the thread-unsafe way."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(directory: str | Path) -> None:
    """Make a rename (or a new entry) in ``directory`` durable; best effort off POSIX."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling(path: Path, make) -> Path:
    """A new temporary sibling of ``path``, created by ``make(tmp)`` (which fails if it exists)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue


def _new_file(tmp: Path) -> None:
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` (an empty file) for a writer that wants a
    name; on success it is fsync'ed and renamed over ``path``, on failure removed."""
    path = Path(path)
    tmp = _sibling(path, _new_file)
    try:
        yield tmp
        _settle_file(tmp, _plain_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """``open(path, mode)``, atomically: ``mode`` is ``"w"`` (text) or ``"wb"``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        kw = {"encoding": encoding} if mode == "w" else {}
        with open(tmp, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding) as f:
        f.write(text)


def write_json(path: str | Path, obj: Any, **dumps: Any) -> None:
    """``json.dumps(obj, **dumps)`` plus a final newline (``indent=2`` unless given)."""
    dumps.setdefault("indent", 2)
    write_text(path, json.dumps(obj, **dumps) + "\n")


def _plain_mode() -> int:
    return 0o666 & ~process_umask()


def _settle_file(path: Path, mode: int) -> None:
    """Give ``path`` a plain ``open()``'s mode and make its content durable."""
    os.chmod(path, mode)
    _fsync_file(path)


def _settle_tree(root: Path) -> None:
    mode = _plain_mode()
    for folder, _, files in os.walk(root):
        for name in files:
            _settle_file(Path(folder) / name, mode)
        fsync_dir(folder)


# renameat2(2)'s RENAME_EXCHANGE: swap two paths in one step (Linux >= 3.15; ext4, xfs, btrfs,
# tmpfs, overlayfs...). Elsewhere, or on a file system that refuses it, two renames.
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any = None


def _load_renameat2() -> Any:
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.renameat2
                c_int, c_path = ctypes.c_int, ctypes.c_char_p
                fn.argtypes = [c_int, c_path, c_int, c_path, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
            except (OSError, AttributeError):  # glibc < 2.28, musl without it
                pass
    return _renameat2


def exchange_paths(a: str | Path, b: str | Path) -> bool:
    """Swap ``a`` and ``b`` atomically (both must exist): True when done, False when this
    platform or file system cannot (the caller falls back); other errors raise OSError."""
    fn = _load_renameat2()
    if not fn:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _swap_in(tmp: Path, directory: Path) -> Path | None:
    """Put ``tmp`` at ``directory``; -> where the old folder now is (to delete), or None.

    With an old folder there, one atomic exchange when the platform has it: a reader
    opening ``directory/...`` always finds the old folder or the new one, never neither.
    The fallback moves the old one aside first (a window of two renames without it).
    """
    if not directory.exists():
        os.replace(tmp, directory)
        return None
    if exchange_paths(tmp, directory):
        return tmp  # holds the old folder now
    old = _sibling(directory, lambda p: os.mkdir(p, 0o700))
    os.replace(directory, old / "old")
    try:
        os.replace(tmp, directory)
    except BaseException:
        os.replace(old / "old", directory)  # put the previous one back
        shutil.rmtree(old, ignore_errors=True)
        raise
    return old


@contextlib.contextmanager
def atomic_dir(directory: str | Path) -> Iterator[Path]:
    """Yield a new temporary folder next to ``directory``; on success its files get a
    plain ``open()``'s mode and are fsync'ed, and it replaces ``directory`` in one atomic
    exchange where the platform allows it (see :func:`_swap_in`); the old one is deleted
    only once out of the way, so it is never seen half-deleted. On failure the temporary
    folder is removed and ``directory`` is left as it was."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(directory, lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        _settle_tree(tmp)
        old = _swap_in(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: str | os.PathLike) -> str:
    """The file's sha256 (hex), read in 1 MiB chunks: the one checksum of every file the
    project writes or checks (artifacts, prepared shards, checkpoints, fetched data, bulk)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
