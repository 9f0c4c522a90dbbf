"""Logical paged KV block accounting (block pool, block tables, prefix caching).

Pure Python: imports no torch. The physical pool lives in each stage worker; block ids handed
out here mean the same slots on every stage.
"""

from kvcache.block_table import BlockCopy, BlockTable, KVCacheUsage, PrefixHit
from kvcache.config import KVCacheConfig
from kvcache.errors import IntegrityError, KVCacheError, StalePrefixHitError
from kvcache.hashing import BlockHash, BlockHashChain, hash_block
from kvcache.manager import KVCacheManager

__all__ = [
    "BlockCopy",
    "BlockHash",
    "BlockHashChain",
    "BlockTable",
    "IntegrityError",
    "KVCacheConfig",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheUsage",
    "PrefixHit",
    "StalePrefixHitError",
    "hash_block",
]
