"""Logical paged KV block accounting (block pool, block tables, prefix caching).

Pure Python: imports no torch. The physical pool lives in each stage worker."""
