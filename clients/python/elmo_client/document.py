"""``embed_document``'s protocol: the request, and the streamed answer read line by line.

``POST /v1/embed/document`` takes ``/v1/embed``'s output options, ``"document"`` (a string,
or a list of words) and ``"chunk_tokens"``; it answers ``application/x-ndjson``: one line
per chunk, shaped as one element of ``/v1/embed``'s ``data`` plus ``"chunk": k``, then
``{"done": true, "chunks": n, "tokens": T}``; a line ``{"error": {...}}`` ends a failed
stream. :class:`DocumentReader` checks every line (each chunk in order, shaped for its own
tokens, finite; the last line's counts against what came) and raises ServiceError for
anything else, a stream cut short included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elmo_client.answers import BadAnswer, Expect, document_line
from elmo_client.errors import ServiceError, bad_answer
from elmo_client.shared import EmbeddedSentence, InputError, check_document
from elmo_client.wire import MALFORMED, Call, check_priority, output_body

PATH = "/v1/embed/document"


class DocumentReader:
    """Feeds on the answer's lines; yields each chunk's sentence; ``finish`` at the end."""

    def __init__(self, expect: Expect, url: str) -> None:
        self.expect, self.url = expect, url
        self.chunks = self.tokens = 0
        self.done: dict[str, int] | None = None

    def feed(self, line: bytes | str) -> EmbeddedSentence | None:
        raw = line.encode() if isinstance(line, str) else line
        if not raw.strip():
            return None
        if self.done is not None:
            raise bad_answer(200, self.url, "a line came after the last one (done)")
        try:
            got = document_line(raw, self.expect, self.chunks, self.url)
        except ServiceError:
            raise
        except MALFORMED as e:  # BadAnswer, orjson's errors, a missing key
            raise bad_answer(200, self.url, f"chunk {self.chunks}: {e}") from None
        if got.done is not None:
            self.done = got.done
            return None
        self.chunks += 1
        self.tokens += len(got.sentence.tokens)
        return got.sentence

    def cut(self, e: BaseException) -> ServiceError:
        """The connection failed once the answer had begun (dropped, or no chunk within
        ``timeout``): the answer is incomplete, so it is the service's error, not a retry."""
        why = str(e) or type(e).__name__
        return ServiceError(
            200, "stream_cut", f"the stream was cut after {self.chunks} chunks: {why}",
            None, self.url,
        )  # fmt: skip

    def finish(self) -> None:
        if self.done is None:
            raise bad_answer(
                200, self.url,
                f"the stream ended after {self.chunks} chunks without its last line (done)",
            )  # fmt: skip
        if (self.done["chunks"], self.done["tokens"]) != (self.chunks, self.tokens):
            raise bad_answer(
                200, self.url,
                f"the last line counts {self.done['chunks']} chunks and {self.done['tokens']} "
                f"tokens; {self.chunks} chunks of {self.tokens} tokens came",
            )  # fmt: skip


def document_call(
    url: str,
    document: str | Sequence[str],
    chunk_tokens: int | None,
    *,
    mix: Any,
    granularity: str,
    output: str | None,
    pooling: str,
    priority: str | None,
) -> tuple[Call, DocumentReader]:
    """The request, and the reader of its answer (the document checked as the library
    checks it before tokenizing)."""
    if not isinstance(document, str) and not (
        isinstance(document, Sequence) and all(isinstance(w, str) for w in document)
    ):
        raise InputError("document must be a string or a list of strings", field="document")
    check_document(document)  # the library's text rule (a lone surrogate: no UTF-8 form)
    if chunk_tokens is not None and (
        not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1
    ):
        raise InputError("chunk_tokens must be a positive integer", field="chunk_tokens")
    check_priority(priority)
    body: dict[str, Any] = {
        "document": document if isinstance(document, str) else list(document),
        "chunk_tokens": chunk_tokens,
        **output_body(mix=mix, output=output, granularity=granularity, pooling=pooling),
    }
    if priority is not None:
        body["priority"] = priority
    expect = Expect.of(mix=mix, output=output, granularity=granularity, pooling=pooling)
    return Call("POST", PATH, body), DocumentReader(expect, url + PATH)


__all__ = ["BadAnswer", "DocumentReader", "document_call"]
