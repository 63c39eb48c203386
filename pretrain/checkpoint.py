"""Training checkpoints: atomic, content-hashed, pruned, loadable with ``weights_only=True``.

    run_dir/checkpoints/step-00001000.pt
    run_dir/checkpoints/step-00001000.pt.sha256    "<sha256 hex>  step-00001000.pt"

A checkpoint is a dict of tensors and primitive containers only (no pickled
classes): model and optimizer state dicts, the step, the data position
(epoch, batch index), per-rank RNG states and counters.

**Writing.** The payload goes to a temporary file in the same folder through
a hashing writer (sha256 of exactly the bytes written); the sidecar
``<name>.sha256`` is written atomically (:mod:`elmo_service.atomic`: temp file,
fsync, ``os.replace``, fsync of the folder) *before* the checkpoint is fsync'ed
and renamed into its name. So a
checkpoint file under its final name always has its hash next to it; a crash
mid-write leaves at most a stray ``.tmp`` file or a sidecar without a
checkpoint (both removed by the next save). The sidecar is in ``sha256sum``
format: ``cd checkpoints && sha256sum -c step-00001000.pt.sha256`` checks
one by hand.

**Verifying.** A checkpoint is *verified* when the sha256 of its file equals
its sidecar, *corrupt* when it differs (a bit flip, a truncation, a partial
copy) or the sidecar is unreadable, and *unhashed* when it has no sidecar (a
checkpoint from before hashes: it still loads, with a note).
:func:`load_checkpoint` refuses a corrupt one.

**Resuming.** :func:`load_latest` walks from the newest checkpoint back and
returns the first that verifies (or is unhashed) and loads. When checkpoints
exist but none of them does, it raises :class:`CheckpointError`: the
trainer's ``--resume`` then fails with one line and exit 2, and nothing in
the run folder is deleted; a run never silently restarts from step 0 over
its own history.

**Non-finite weights.** :func:`save_checkpoint` refuses a model state that
holds a NaN or an infinity (:class:`NonFiniteCheckpoint`), so a diverged run
never writes one. A non-finite checkpoint found on disk (written elsewhere, or
by an older version) is *non-finite*: never resumed from, never counted as
good by pruning, and left in place.

**Pruning** (after each save) keeps the ``keep`` newest *good* checkpoints
(verified or unhashed) by step and deletes older good ones, and deletes
corrupt ones (they can never be resumed from; the save that prunes has just
written a verified one). So a corrupt or non-finite checkpoint never
displaces a good one, and the newest good checkpoint is never deleted.

**A full disk** (or any write error) while saving is one
:class:`CheckpointError` naming the file; the temporary file is removed and
the checkpoints already there are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

# the folder's layout (names, listing) is run_dir's: the job runner reads it without torch
from elmo_pretrain.run_dir import checkpoint_dir, list_checkpoints
from elmo_service.atomic import atomic_open, sha256_file, write_text
from elmo_service.errors import ElmoServiceError

log = logging.getLogger("elmo_pretrain.checkpoint")

_SIDECAR = re.compile(r"^([0-9a-f]{64})  (step-\d{8,}\.pt)\n?$")
HASH_SUFFIX = ".sha256"

Status = Literal["verified", "unhashed", "corrupt", "nonfinite"]


class CheckpointError(ElmoServiceError):
    """No checkpoint in a run folder can be resumed from, or one is corrupt."""

    code = "bad_checkpoint"


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's content does not match its hash."""


class NonFiniteCheckpoint(CheckpointError):
    """A model state holds NaN or infinite values."""


def nonfinite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``state`` that hold a NaN or an infinity."""
    return [
        k
        for k, t in state.items()
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and not bool(torch.isfinite(t).all())
    ]


def describe_nonfinite(names: list[str], total: int) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} of {total} weight tensors hold NaN or infinity ({shown})"


def sidecar(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + HASH_SUFFIX)


# ------------------------------------------------------------------ hashing


class _HashingWriter:
    """A write-only file object that hashes what passes through (torch.save streams into it)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = None  # torch.save reports a failed write as RuntimeError

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def expected_sha256(path: str | Path) -> str | None:
    """The hash recorded for ``path``; None without a sidecar. Raises CorruptCheckpoint
    when the sidecar exists but is not a valid record for this file."""
    p = Path(path)
    try:
        text = sidecar(p).read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{p.name}: hash file unreadable ({e})", field="checkpoint") from e
    m = _SIDECAR.match(text)
    if m is None or m.group(2) != p.name:
        raise CorruptCheckpoint(f"{p.name}: hash file is malformed", field="checkpoint")
    return m.group(1)


def verify_checkpoint(path: str | Path) -> bool:
    """True: the content matches its hash; False: no hash recorded (an old checkpoint).
    Raises CorruptCheckpoint on a mismatch."""
    want = expected_sha256(path)
    if want is None:
        return False
    got = sha256_file(path)
    if got != want:
        raise CorruptCheckpoint(
            f"{Path(path).name}: content hash mismatch (sha256 {got[:12]}..., recorded {want[:12]}...)",
            field="checkpoint",
        )
    return True


# verdicts of files this process has already hashed, keyed by the checkpoint's and its
# sidecar's (size, mtime): pruning after every save must not re-read every kept checkpoint
_verdicts: dict[tuple, Status] = {}


def _stat_key(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    try:
        h = sidecar(path).stat()
        hs: tuple = (h.st_size, h.st_mtime_ns)
    except OSError:
        hs = ()
    return (str(path), st.st_size, st.st_mtime_ns, *hs)


def checkpoint_status(path: str | Path) -> Status:
    """verified | unhashed | corrupt (cached per file version within this process)."""
    p = Path(path)
    key = _stat_key(p)
    if key is not None and key in _verdicts:
        return _verdicts[key]
    try:
        status: Status = "verified" if verify_checkpoint(p) else "unhashed"
        try:  # mmap: the weights are read once, by the check, not copied into memory
            st = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file torch cannot map (an old serialization format)
            st = torch.load(p, map_location="cpu", weights_only=True)
        if nonfinite_tensors(st.get("model", {}) if isinstance(st, dict) else {}):
            status = "nonfinite"
    except (CorruptCheckpoint, OSError):
        status = "corrupt"
    except Exception:  # the hash matches but torch cannot read it: a file written broken
        status = "corrupt"
    if key is not None:
        _verdicts[key] = status
    return status


# ------------------------------------------------------------------ writing


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as ``step-<step>.pt`` with its hash, then prune. Returns the path.

    Raises NonFiniteCheckpoint (nothing written) when the model state holds NaN or
    infinity, and CheckpointError naming the file when it cannot be written (a full disk).
    """
    d = checkpoint_dir(run_dir)
    path = d / f"step-{step:08d}.pt"
    model = state.get("model", {})
    if bad := nonfinite_tensors(model):
        raise NonFiniteCheckpoint(
            f"{path.name} not written: {describe_nonfinite(bad, len(model))}", field="checkpoint"
        )
    w: _HashingWriter | None = None
    try:
        d.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            w = _HashingWriter(f)
            torch.save(state, w)
            # the hash lands first (the checkpoint is renamed when this block ends): a
            # checkpoint under its final name always has one
            write_text(sidecar(path), f"{w.sha.hexdigest()}  {path.name}\n", encoding="ascii")
    except (OSError, RuntimeError) as e:
        os_error = e if isinstance(e, OSError) else (w.error if w is not None else None)
        if os_error is None:
            raise
        why = os_error.strerror or str(os_error)
        name = errno.errorcode.get(os_error.errno or 0)
        # one line: the chained torch/OSError tracebacks say nothing more
        raise CheckpointError(
            f"cannot write checkpoint {path}: {why}{f' ({name})' if name else ''}; "
            "the checkpoints already there are intact",
            field="checkpoint",
        ) from None
    key = _stat_key(path)
    if key is not None:
        _verdicts[key] = "verified"
    prune(run_dir, keep)
    for stray in d.glob(".step-*.tmp"):  # left by an earlier crash
        stray.unlink(missing_ok=True)
    return path


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Keep the ``keep`` newest good checkpoints; delete older good ones and corrupt ones.
    Returns the deleted checkpoint paths."""
    ckpts = list_checkpoints(run_dir)
    status = {p: checkpoint_status(p) for p in ckpts}
    good = [p for p in ckpts if status[p] in ("verified", "unhashed")]
    if not good:  # never reached from save_checkpoint (it just wrote one); delete nothing
        return []
    doomed = good[:-keep] + [p for p in ckpts if status[p] == "corrupt"]
    for p in doomed:
        if status[p] == "corrupt":
            log.warning(
                "deleting corrupt checkpoint %s (its content does not match its hash)", p.name
            )
        p.unlink(missing_ok=True)  # the checkpoint first: a lone sidecar is harmless
        sidecar(p).unlink(missing_ok=True)
    names = {p.name for p in list_checkpoints(run_dir)}
    for h in checkpoint_dir(run_dir).glob(f"step-*.pt{HASH_SUFFIX}"):
        if h.name.removesuffix(HASH_SUFFIX) not in names:  # its checkpoint is gone
            h.unlink(missing_ok=True)
    for k in [k for k in _verdicts if not Path(k[0]).exists()]:
        del _verdicts[k]
    return doomed


# ------------------------------------------------------------------ reading


def load_checkpoint(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Load one checkpoint (tensors on the CPU). Raises CorruptCheckpoint when its content
    does not match its recorded hash; one without a hash loads unverified."""
    if verify:
        verify_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_latest(run_dir: str | Path, log=print) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads; None when there is none at all.

    Corrupt or unreadable ones are reported through ``log`` and skipped. Raises
    CheckpointError (one line, naming each checkpoint and why) when checkpoints
    exist but none can be resumed from; nothing is deleted.
    """
    ckpts = list_checkpoints(run_dir)
    why: list[str] = []
    for path in reversed(ckpts):
        try:
            hashed = verify_checkpoint(path)
            st = torch.load(path, map_location="cpu", weights_only=True)
            model = st.get("model", {}) if isinstance(st, dict) else {}
            if bad := nonfinite_tensors(model):
                raise NonFiniteCheckpoint(describe_nonfinite(bad, len(model)))
        except Exception as e:  # hash mismatch, truncated zip, bad pickle opcode, ...
            reason = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            reason = " ".join(str(reason).split())[:160]
            log(f"warning: checkpoint {path.name} is unreadable ({reason}); trying an older one")
            why.append(f"{path.name}: {reason}")
            continue
        if not hashed:
            log(
                f"note: checkpoint {path.name} has no content hash (written before hashes); loaded unverified"
            )
        return path, st
    if ckpts:
        raise CheckpointError(
            f"--resume: none of the {len(ckpts)} checkpoints in {checkpoint_dir(run_dir)} can be resumed from "
            f"({'; '.join(why)}); nothing was deleted: restore a good copy, or start over with --force",
            field="run_dir",
        )
    return None
