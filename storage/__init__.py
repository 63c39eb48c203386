"""The plumbing every store shares, below ``api/`` and ``jobs/`` (neither imports the other
for it): Redis clients built one way (:mod:`elmo_storage.redis_client`: timeouts, no retries,
the password), Redis replies checked one way (:mod:`elmo_storage.replies`: :class:`BadReply`,
:func:`describe`, the one :class:`StoreUnavailable`), and file locks one way
(:mod:`elmo_storage.locks`). The stores themselves (the vector cache, tasks, the fleet, jobs)
keep their schemas in their own packages.
"""

from elmo_storage.locks import file_lock
from elmo_storage.redis_client import RedisAuthError, check_auth, connect, redact
from elmo_storage.replies import (
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
