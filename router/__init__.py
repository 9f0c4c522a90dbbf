"""The router: public API, validation, tokenization, scheduling and logical KV blocks.

Imports no torch (a test proves it)."""
