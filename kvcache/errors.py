"""Typed errors of the kvcache package."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of every error raised by kvcache."""


class IntegrityError(KVCacheError):
    """``check_integrity()`` found the pool, the tables or the prefix cache inconsistent, or a
    caller's bookkeeping (the scheduler's) disagreeing with the manager's answers.

    Always a bug.
    """


class StalePrefixHitError(KVCacheError):
    """A ``PrefixHit`` was used after the pool changed and one of its blocks was evicted."""
