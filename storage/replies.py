"""Redis replies checked one way, and the one error a store raises when Redis fails it.

A Redis that answers, but not with what the command returns (a wrong type or length: a
misbehaving proxy, a "Redis-compatible" server), is a failure like one that does not
answer. Each store checks its replies with :func:`expect` and turns every failure into
:class:`StoreUnavailable` with :func:`unavailable` (the cache, which never raises, counts
:func:`client_errors` instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class StoreUnavailable(Exception):
    """A store's backend (Redis) did not answer, refused us, or answered nonsense."""


class BadReply(Exception):
    """Redis answered, but not with what the command returns (its type or length)."""


# what redis-py's reply callbacks (and rq on top of them) raise on a reply of the wrong
# shape; pydantic's ValidationError (rq's own models) is a ValueError
REPLY_SHAPE_ERRORS: tuple[type[Exception], ...] = (
    BadReply, TypeError, ValueError, AttributeError, IndexError, KeyError,
)  # fmt: skip


def client_errors() -> tuple[type[BaseException], ...]:
    """Everything a Redis call can raise for the store's sake, not ours."""
    import redis

    return (redis.RedisError, OSError, *REPLY_SHAPE_ERRORS)


def describe(reply: object) -> str:
    """A short name for an unexpected reply, for logs and errors."""
    if isinstance(reply, list | tuple):
        return f"an array of {len(reply)}"
    if isinstance(reply, bytes | str):
        return f"a string {reply[:16]!r}"
    return f"{type(reply).__name__} {reply!r:.32}"


def expect(ok: bool, what: str, reply: object) -> None:
    """BadReply naming the command and the reply unless ``ok``."""
    if not ok:
        raise BadReply(f"{what} answered {describe(reply)}")


@contextlib.contextmanager
def unavailable(what: str) -> Iterator[None]:
    """The one place a Redis failure becomes :class:`StoreUnavailable` (``what``: "job
    store", "task store", "fleet state"): the client's errors (connection, timeout, an
    error reply, a refused password) and a reply of the wrong shape. Nothing broader."""
    import redis

    try:
        yield
    except StoreUnavailable:
        raise
    except redis.AuthenticationError as e:
        raise StoreUnavailable(f"{what} (redis) refused the password: {e}") from e
    except (redis.RedisError, OSError) as e:
        raise StoreUnavailable(f"{what} (redis) unavailable: {type(e).__name__}: {e}") from e
    except REPLY_SHAPE_ERRORS as e:
        raise StoreUnavailable(f"{what} (redis) answered garbage: {type(e).__name__}: {e}") from e


def never_sent(e: BaseException) -> bool:
    """Whether the failure ``e`` (or its cause) happened before a command reached Redis: no
    connection could be made, or the password was refused. Any other failure (a timeout, a
    connection lost mid-call) leaves the command's outcome unknown."""
    import redis

    cause = e.__cause__ if isinstance(e, StoreUnavailable) and e.__cause__ else e
    if isinstance(cause, redis.AuthenticationError):
        return True
    # redis-py's connect failures read "Error <errno> connecting to <host>:<port>. ..."
    return isinstance(cause, redis.ConnectionError) and " connecting to " in str(cause)
