"""The plumbing every store shares, below ``api/`` and ``jobs/`` (neither imports the other
for it): Redis clients built one way (:mod:`storage.redis_client`: timeouts, no retries,
the password), Redis replies checked one way (:mod:`storage.replies`: :class:`BadReply`,
:func:`describe`, the one :class:`StoreUnavailable`), and file locks one way
(:mod:`storage.locks`). The stores themselves (the vector cache, tasks, the fleet, jobs)
keep their schemas in their own packages.
"""

from storage.locks import file_lock
from storage.redis_client import RedisAuthError, check_auth, connect, redact
from storage.replies import (
    REPLY_SHAPE_ERRORS,
    BadReply,
    StoreUnavailable,
    client_errors,
    describe,
    expect,
    never_sent,
    unavailable,
)

__all__ = [
    "REPLY_SHAPE_ERRORS",
    "BadReply",
    "RedisAuthError",
    "StoreUnavailable",
    "check_auth",
    "client_errors",
    "connect",
    "describe",
    "expect",
    "file_lock",
    "never_sent",
    "redact",
    "unavailable",
]
