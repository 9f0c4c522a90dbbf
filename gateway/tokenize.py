"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version.

/tokenize takes a completions-style `prompt` (text) or a chat-style `messages` list (with
`tools`, given to the chat template as generation gives them) and
answers `{"count", "max_model_len", "tokens", "token_strs"}` with the ids Generate would
use (the router's `Tokenize`: its tokenizer and chat template). /detokenize takes `tokens`
and answers `{"prompt"}` (the router's `Detokenize`). Both name the offending field in a 400,
as the generation endpoints do; unknown fields are refused the same way.
"""

from __future__ import annotations

from importlib import metadata

import grpc

from gateway.connections import RouterConnections
from gateway.errors import APIError, from_rpc_error, invalid
from gateway.fields import Fields
from gateway.http import Exchange
from gateway.params import parse_messages
from gateway.served import ModelView, ModelViewLoader
from gateway.tools import parse_tools


def version() -> str:
    try:
        return metadata.version("stagemesh")
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenizeHandlers:
    def __init__(self, router: RouterConnections, served: ModelViewLoader,
                 max_body_bytes: int) -> None:
        self.router = router
        self.served = served
        self.max_body_bytes = max_body_bytes

    async def tokenize(self, ex: Exchange) -> None:
        f = Fields(await ex.read_json(self.max_body_bytes))
        text, raw_messages = f.string("prompt"), f.array("messages")
        if (text is None) == (raw_messages is None):
            raise invalid("prompt", "give exactly one of prompt (text) and messages")
        messages = tools = None
        if text is not None:
            _default_only(f, "add_special_tokens", True)  # as Generate tokenizes
        else:
            messages = parse_messages(raw_messages)
            tools = parse_tools(f)  # given to the chat template
            _default_only(f, "add_generation_prompt", True)
            _default_only(f, "add_special_tokens", False)
        token_strs = bool(f.boolean("return_token_strs"))
        view, model = await self._model(f)
        f.refuse_unknown()
        try:
            reply = await self.router.first.tokenize_reply(text, messages, model, tools)
        except grpc.RpcError as e:
            raise from_rpc_error(e, {"prompt_token_ids": "prompt"}) from e
        await ex.json(200, {"count": len(reply.token_ids), "max_model_len": view.context_length,
                            "tokens": list(reply.token_ids),
                            "token_strs": list(reply.tokens) if token_strs else None})

    async def detokenize(self, ex: Exchange) -> None:
        f = Fields(await ex.read_json(self.max_body_bytes))
        tokens = f.integers("tokens")
        if tokens is None:
            raise invalid("tokens", "tokens is required")
        _, model = await self._model(f)
        f.refuse_unknown()
        try:
            text = await self.router.first.detokenize(tokens, model=model)
        except grpc.RpcError as e:
            raise from_rpc_error(e, {"token_ids": "tokens"}) from e
        await ex.json(200, {"prompt": text})

    async def _model(self, f: Fields) -> tuple[ModelView, str]:
        """The served model's view and the `model` to send the router (another name is a
        404, as on the other endpoints)."""
        try:
            view = await self.served.get()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return view, self.served.router_model(view, f.string("model"))


def _default_only(f: Fields, key: str, default: bool) -> None:
    value = f.boolean(key)
    if value is not None and value != default:
        raise APIError(400, f"{key} = {str(value).lower()} is not supported here: prompts "
                            f"are tokenized as generation tokenizes them", param=key,
                       code="invalid_argument")
