"""Redis clients built one way: explicit timeouts, no silent retries, the password.

The password comes from the URL (``redis://:PASSWORD@host:6379/0``) or, for a URL that
carries none, from ``ELMO_REDIS_PASSWORD`` (the deploy manifests set it from a Secret).
Every client of the project (cache, tasks, fleet, jobs and rq's) is made here.
A wrong or missing password is not an outage: :func:`check_auth` tells it apart at
startup, so a process fails closed with one line instead of running without its store.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit


class RedisAuthError(Exception):
    """Redis refused the password (wrong, or none given where one is required)."""


def _has_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False


def redact(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _secret(password: Any) -> str | None:
    """A password given as str or as pydantic's SecretStr (the settings' type)."""
    if password is not None and hasattr(password, "get_secret_value"):
        password = password.get_secret_value()
    return password or None


def connect(
    url: str,
    *,
    password: Any = None,
    timeout: float | None = 0.5,
    connect_timeout: float | None = None,
    retries: int | None = 0,
    **options: Any,
):
    """A ``redis.Redis`` for ``url``: socket and connect timeouts (``timeout``; ``None``:
    reads wait, for pub/sub), no retries unless asked (``retries=None``: redis-py's own,
    for rq), and ``password`` unless the URL has its own. ``options`` go to redis-py."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect_timeout if connect_timeout is not None else timeout,
        **options,
    }
    if retries is not None:
        kw["retry"] = Retry(NoBackoff(), retries)
    if _secret(password) and not _has_password(url):
        kw["password"] = _secret(password)
    return redis.Redis.from_url(url, **kw)


def check_auth(url: str, password: Any = None, timeout: float = 2.0) -> bool:
    """PING ``url`` with the password: True when it answers, False when it is not
    reachable (an outage: the stores ride it out), RedisAuthError when it refuses us."""
    import redis

    client = connect(url, password=password, timeout=timeout)
    try:
        client.ping()
        return True
    except redis.AuthenticationError as e:  # WRONGPASS, NOAUTH, or a password it has none for
        if not _secret(password) and not _has_password(url):
            why = "requires a password: set ELMO_REDIS_PASSWORD (or redis://:PASSWORD@host:port/0)"
        else:
            why = f"refused the password ({str(e).rstrip('.')}): check ELMO_REDIS_PASSWORD"
        raise RedisAuthError(f"redis at {redact(url)} {why}") from e
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
