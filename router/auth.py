"""API keys on the router's public API: calls to `stagemesh.v1.InferenceService` need
metadata `authorization: Bearer <key>`. Health and reflection stay open (probes and
discovery carry no key)."""

from __future__ import annotations

from foundation.api_keys import ApiKeys
from foundation.grpc_auth import BearerInterceptor

PROTECTED_PREFIX = "/stagemesh.v1.InferenceService/"
MESSAGE = ("missing or incorrect API key: send gRPC metadata 'authorization: Bearer <key>'")


def api_key_interceptor(keys: ApiKeys) -> BearerInterceptor:
    return BearerInterceptor(keys, PROTECTED_PREFIX, MESSAGE)
