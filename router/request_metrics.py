"""What a front records of each request into its `FrontMetrics`, as the request's client sees it.

This module owns the per-request accounting of the front's Prometheus metrics: when an update
with tokens goes to a request's stream, its time to first token or its inter-token latency;
when the request ends (completed, failed or aborted), its end-to-end latency, the tokens it
generated, how each choice ended or why the request failed, and, for a completed request, its
prompt tokens and time per output token. It reads the request's `RequestState` and writes only
the metrics and the state's update timestamps; `router.frontend` calls it where a front has
metrics.
"""

from __future__ import annotations

import time

from router.metrics import FrontMetrics
from router.outputs import RequestDone, RequestFailed, StreamItem
from router.request_state import RequestState
from router.scheduler.sequence import FinishReason


def note_update(metrics: FrontMetrics, state: RequestState) -> None:
    """An update with tokens goes to the request's stream: its TTFT or an ITL. Sets the
    state's `first_update` (the first time) and `last_update`."""
    now = time.monotonic()
    if state.first_update is None:
        state.first_update = now
        metrics.ttft.observe(now - state.arrived)
    else:
        metrics.observe_itl(now - state.last_update)
    state.last_update = now


def note_end(metrics: FrontMetrics, state: RequestState, last: StreamItem | None) -> None:
    """The request ends: completed (`RequestDone`), failed, or aborted (None)."""
    metrics.e2e.observe(time.monotonic() - state.arrived)
    metrics.publish_itls()  # its inter-token latencies are all counted once it ends
    metrics.generation_tokens.inc(state.completion_tokens)
    if isinstance(last, RequestFailed):
        metrics.failures.labels(last.kind.value).inc()
        return
    for choice in state.choices.values():
        reason = choice.finish_reason or FinishReason.ABORT
        metrics.success.labels(reason.value).inc()
    if isinstance(last, RequestDone):
        metrics.prompt_tokens.inc(len(state.request.prompt_token_ids))
        per_choice = state.completion_tokens / len(state.choices)
        if state.first_update is not None and per_choice > 1:
            metrics.tpot.observe((state.last_update - state.first_update)
                                 / (per_choice - 1))
