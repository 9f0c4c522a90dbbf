"""Request validation and admission limits: the two typed refusals the mesh maps to status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from router.scheduler.config import SchedulerConfig
from router.scheduler.errors import (
    AdmissionRefusedError,
    DuplicateSeqIdError,
    InvalidRequestError,
    RefusalReason,
)
from router.scheduler.sequence import ChoiceSpec
from router.scheduler.sequence import Sequence as Seq
from router.scheduler.waiting_queue import WaitingQueue


def validate_request(config: SchedulerConfig, prompt: Sequence[int], seq_id: int,
                     choices: Sequence[ChoiceSpec], live: Mapping[int, Seq]) -> None:
    """Refuse a request that could never run as given.

    Raises:
        InvalidRequestError: empty prompt; a prompt with no room left for one generated
            token within ``max_model_len``; more choices than may run at once.
        DuplicateSeqIdError: a sequence id is repeated or already live.
    """
    if not prompt:
        raise InvalidRequestError("the prompt is empty; it needs at least one token")
    if len(prompt) >= config.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; the limit is {config.max_model_len - 1} "
            f"(max_model_len {config.max_model_len} includes one generated token)")
    if 1 + len(choices) > config.max_running_seqs:
        raise InvalidRequestError(
            f"{1 + len(choices)} choices requested; at most {config.max_running_seqs} can run")
    ids = [seq_id, *(c.seq_id for c in choices)]
    if len(set(ids)) != len(ids) or any(i in live for i in ids):
        raise DuplicateSeqIdError(f"sequence ids {ids} are repeated or already live")


def check_admission(config: SchedulerConfig, waiting: WaitingQueue, num_prompt_tokens: int) -> None:
    """Refuse a new request when the waiting queue is at a limit.

    Raises:
        AdmissionRefusedError: ``max_queued_requests`` or ``max_queued_tokens`` would be
            exceeded (RESOURCE_EXHAUSTED: retry later).
    """
    if waiting.num_seqs + 1 > config.max_queued_requests:
        raise AdmissionRefusedError(RefusalReason.QUEUED_REQUESTS, config.max_queued_requests,
                                    waiting.num_seqs, 1)
    if waiting.num_tokens + num_prompt_tokens > config.max_queued_tokens:
        raise AdmissionRefusedError(RefusalReason.QUEUED_TOKENS, config.max_queued_tokens,
                                    waiting.num_tokens, num_prompt_tokens)
