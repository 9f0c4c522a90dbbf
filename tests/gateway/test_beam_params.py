"""vLLM's beam search fields on the gateway: what reaches the router, what is refused with a
400 naming the field, and the router's beam search errors in the client's names."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from gateway.errors import APIError, from_rpc_error
from gateway.generate import _renames
from gateway.params import parse_chat, parse_completions
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import build_request


def _completions(**body: Any) -> Any:
    return parse_completions({"prompt": "hi", **body}, max_prompts=4)


def test_use_beam_search_sends_the_width_penalty_and_stopping() -> None:
    spec = _completions(use_beam_search=True, n=2, best_of=4, length_penalty=0.5,
                        early_stopping="never")
    beam = spec.options["beam_search"]
    assert beam == {"beam_width": 4, "length_penalty": 0.5, "early_stopping": "never"}
    req = build_request("hi", beam_search=beam)
    assert req.beam_search.beam_width == 4 and req.beam_search.length_penalty == 0.5
    assert req.beam_search.early_stopping == pb.BEAM_EARLY_STOPPING_NEVER
    plain = build_request("hi", beam_search=_completions(use_beam_search=True)
                          .options["beam_search"])
    assert plain.HasField("beam_search") and not plain.beam_search.HasField("beam_width")
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                       "use_beam_search": True, "early_stopping": True})
    assert chat.options["beam_search"]["early_stopping"] is True
    assert _completions().options["beam_search"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"best_of": 3}, "best_of"),  # best_of > n needs use_beam_search
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"use_beam_search": True, "early_stopping": "soon"}, "early_stopping"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": True, "length_penalty": "long"}, "length_penalty"),
])
def test_bad_beam_fields_are_400_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as bad:
        _completions(**body)
    assert bad.value.status == 400 and bad.value.param == param
    assert param in bad.value.message


class _RpcError(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return self._details


def test_router_beam_errors_use_the_client_names() -> None:
    width = "beam_search.beam_width must be between n (2) and 10, got 11"
    with_best_of = _renames(_completions(use_beam_search=True, n=2, best_of=11))
    err = from_rpc_error(_RpcError(width), with_best_of)
    assert err.param == "best_of" and err.message.startswith("best_of must be between")
    only_n = _renames(_completions(use_beam_search=True, n=11))
    assert from_rpc_error(_RpcError(width), only_n).param == "n"
    temperature = from_rpc_error(_RpcError("temperature cannot be combined with beam search"),
                                 with_best_of)
    assert temperature.param == "temperature"
