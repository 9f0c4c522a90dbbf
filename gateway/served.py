"""What the router serves, as clients of the gateway see it: fetched once, lazily.

The gateway may start before the router (a sidecar in a pod); a request that arrives before
the router answers GetModelInfo gets the router's status (UNAVAILABLE -> 503) and the next
request tries again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from foundation.modelstore import stagemesh_home
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.tokens import TokenTexts, load_token_texts
from router.client import RouterClient

MODEL_INFO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelView:
    """name: what clients send and see in `model`; context_length: prompt + output limit;
    created: when the gateway first saw it (OpenAI's model `created`, Unix seconds);
    texts: token id -> text for logprobs."""

    name: str
    context_length: int
    created: int
    texts: TokenTexts

    def card(self) -> dict[str, object]:
        """The model's entry in /v1/models."""
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "stagemesh", "max_model_len": self.context_length}


class ModelViewLoader:
    """Fetches the `ModelView` from the router once, on first use, and keeps it."""

    def __init__(self, client: RouterClient, cfg: GatewayConfig) -> None:
        self.client = client
        self.cfg = cfg
        self._view: ModelView | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ModelView:
        """The served model; raises `grpc.RpcError` while the router cannot say."""
        if self._view is None:
            async with self._lock:
                if self._view is None:
                    self._view = await self._load()
        return self._view

    async def _load(self) -> ModelView:
        info = await self.client.model_info(timeout=MODEL_INFO_TIMEOUT_S)
        plain = info.model and "/" not in info.model and info.model not in (".", "..")
        store_dir = stagemesh_home() / "models" / info.model if plain else None
        texts = await asyncio.to_thread(load_token_texts, self.cfg.tokenizer_dir, store_dir,
                                        info.vocab_size)
        name = self.cfg.served_model_name or info.model
        return ModelView(name, info.context_length, int(time.time()), texts)

    def router_model(self, view: ModelView, requested: str | None) -> str:
        """The `model` to send the router for a request that named `requested`: "" (the
        router's own) for the served name or none. With `--served-model-name`, another name
        is a 404 here; without, it goes to the router, which answers NOT_FOUND (404)."""
        if requested is None or requested == view.name:
            return ""
        if self.cfg.served_model_name is not None:
            raise APIError(404, f"model {requested!r} does not exist; this server serves "
                                f"{view.name!r}", param="model", code="model_not_found")
        return requested
