"""ApiKeys: which Authorization values pass, and that a check takes the same work and time
whatever the guess."""

from __future__ import annotations

import hmac
import statistics
import time

import pytest

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


def test_every_check_compares_every_key_on_equal_length_digests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The work does not depend on which key (if any) matches or how much of one a guess
    shares: one constant-time comparison per configured key, always of two 32-byte
    digests, whatever the guess."""
    secret = "sk-" + "a" * 40
    keys = ApiKeys([secret, "sk-" + "b" * 40, "short"])
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    for guess in (secret, secret[:-1] + "b", "x" + secret[1:], "", "sk-", "short",
                  secret * 10):
        calls.clear()
        keys.matches(guess)
        assert calls == [(32, 32)] * 3, guess


def test_the_time_of_a_check_does_not_tell_how_close_a_guess_is() -> None:
    """Medians of interleaved batches: the right key, a guess wrong only in its last
    character and one wrong in its first take the same time (within 25 %, far above the
    run-to-run noise of a loaded machine and far below what an early exit would show)."""
    secret = "sk-" + "7" * 61
    keys = ApiKeys([secret, "sk-" + "8" * 61])
    guesses = [secret, secret[:-1] + "0", "0" + secret[1:]]
    samples: list[list[float]] = [[] for _ in guesses]
    for _ in range(60):
        for i, guess in enumerate(guesses):
            start = time.perf_counter()
            for _ in range(200):
                keys.matches(guess)
            samples[i].append(time.perf_counter() - start)
    medians = [statistics.median(s) for s in samples]
    assert max(medians) / min(medians) < 1.25, medians
