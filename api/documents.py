"""What documents may hold at once: streams, tokens in flight and spill bytes, and the
folder their spills live in.

A document (``POST /v1/embed/document``) holds a thread, its tokens and, past a few MB, a
spill file of ``4 (2L+1) P`` bytes a token until its answer ends. Each is bounded by a
setting; a document that would pass one is answered 429 with ``Retry-After`` before any
work starts (``ELMO_MAX_DOCUMENT_STREAMS``, ``ELMO_MAX_DOCUMENT_TOKENS_IN_FLIGHT``,
``ELMO_MAX_DOCUMENT_SPILL_BYTES``). The slots are taken and given back on the event loop
only, so a plain counter is enough.

Spills live in a folder the service owns, ``<ELMO_DOCUMENT_SPILL_DIR>/<pid>`` (default under
the system's temporary folder); files there are unlinked as they are made, and the folders
of processes that no longer run are swept at start (a killed replica leaves none behind
for long).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from elmo_api.errors import ApiError

log = logging.getLogger("api")

RETRY_AFTER_S = 2  # a document slot frees when a stream ends: seconds, not minutes


def spill_bytes(tokens: int, n_layers: int, projection_dim: int) -> int:
    """What a document of ``tokens`` tokens spills: its forward rows ``[e, f_1..f_L]`` and
    backward rows ``[b_1..b_L]``, float32, markers included (``elmo_service/document.py``)."""
    return (tokens + 2) * (2 * n_layers - 1) * projection_dim * 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Slot:
    tokens: int
    spill: int


class DocumentStreams:
    """The document streams running now, against the settings' bounds."""

    def __init__(
        self, *, max_streams: int, max_tokens: int, max_spill_bytes: int, root: str | None
    ) -> None:
        self.max_streams, self.max_tokens, self.max_spill = max_streams, max_tokens, max_spill_bytes
        self.root = Path(root) if root else Path(tempfile.gettempdir()) / "elmo-service-spill"
        self.dir: Path | None = None
        self.streams = self.tokens = self.spill = 0

    @classmethod
    def from_settings(cls, settings) -> DocumentStreams:
        return cls(
            max_streams=settings.max_document_streams,
            max_tokens=settings.max_document_tokens_in_flight,
            max_spill_bytes=settings.max_document_spill_bytes,
            root=settings.document_spill_dir,
        )

    def start(self) -> None:
        """Make this process's spill folder; sweep the folders of processes gone."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in self.root.iterdir():
            pid = int(d.name) if d.name.isdigit() else None
            if d.is_dir() and pid is not None and pid != os.getpid() and not _alive(pid):
                shutil.rmtree(d, ignore_errors=True)
                log.info("document spills: swept %s (its process is gone)", d)
        self.dir = self.root / str(os.getpid())
        self.dir.mkdir(exist_ok=True, mode=0o700)

    def take(self, tokens: int, spill: int) -> Slot:
        """A slot for a document, or a 429 naming the bound it would pass."""
        over = None
        if self.streams + 1 > self.max_streams:
            over = f"{self.streams} document streams run (ELMO_MAX_DOCUMENT_STREAMS)"
        elif self.tokens + tokens > self.max_tokens:
            over = (
                f"{self.tokens:,} document tokens are in flight and this one has {tokens:,} "
                f"(ELMO_MAX_DOCUMENT_TOKENS_IN_FLIGHT {self.max_tokens:,})"
            )
        elif self.spill + spill > self.max_spill:
            over = (
                f"{self.spill:,} bytes of document spills are held and this one needs {spill:,} "
                f"(ELMO_MAX_DOCUMENT_SPILL_BYTES {self.max_spill:,})"
            )
        if over is not None:
            raise ApiError(
                429,
                "overloaded",
                f"the server is at its document limit: {over}; retry later",
                "document",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.streams += 1
        self.tokens += tokens
        self.spill += spill
        return Slot(tokens, spill)

    def give_back(self, slot: Slot) -> None:
        self.streams -= 1
        self.tokens -= slot.tokens
        self.spill -= slot.spill

    @property
    def spill_dir(self) -> str | None:
        return None if self.dir is None else str(self.dir)
