"""ApiKeys: which Authorization values pass."""

from __future__ import annotations

from foundation.api_keys import ApiKeys


def test_bearer_with_any_configured_key_passes() -> None:
    keys = ApiKeys(["alpha", "beta"])
    assert keys
    assert keys.authorizes("Bearer alpha") and keys.authorizes("bearer beta")
    assert keys.authorizes("  Bearer   beta ")
    for header in ("", "alpha", "Bearer", "Bearer gamma", "Basic alpha", "Bearer alph",
                   "Bearer alphaa"):
        assert not keys.authorizes(header), header


def test_no_keys_is_falsy_and_matches_nothing() -> None:
    keys = ApiKeys([])
    assert not keys
    assert not keys.authorizes("Bearer ")
