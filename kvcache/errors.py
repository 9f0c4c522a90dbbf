"""Typed errors of the kvcache package."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of every error raised by kvcache."""


class IntegrityError(KVCacheError):
    """``check_integrity()`` found the pool, the tables or the prefix cache inconsistent.

    Always a bug in kvcache or in a caller that mutated a table it does not own.
    """


class StalePrefixHitError(KVCacheError):
    """A ``PrefixHit`` was used after the pool changed and one of its blocks was evicted."""
