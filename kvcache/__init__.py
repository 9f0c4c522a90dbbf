"""Logical paged KV block accounting (block pool, block tables, prefix caching).

Pure Python: imports no torch. The physical pool lives in each stage worker; block ids handed
out here mean the same slots on every stage. ``KVCacheManager`` is the only owner of blocks
and block tables: callers hold sequence ids and the immutable records it returns.
"""

from kvcache.config import KVCacheConfig
from kvcache.errors import IntegrityError, KVCacheError, StalePrefixHitError
from kvcache.hashing import BlockHash, BlockHashChain, hash_block
from kvcache.manager import KVCacheManager
from kvcache.records import BlockAllocation, BlockCopy, KVCacheUsage, PrefixHit

__all__ = [
    "BlockAllocation",
    "BlockCopy",
    "BlockHash",
    "BlockHashChain",
    "IntegrityError",
    "KVCacheConfig",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheUsage",
    "PrefixHit",
    "StalePrefixHitError",
    "hash_block",
]
