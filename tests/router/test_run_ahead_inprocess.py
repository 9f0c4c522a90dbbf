"""Run-ahead through the in-process mesh (`tests.router.inprocess`): the same tokens with
run-ahead at the configured depth, paced deeper (`router.core.pace`) and off, with fewer
micro-batches than stages, and a stop string found after the next token was planned."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.core.pace import MIN_INTERVALS, RunAheadPace
from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh, stage_configs
from tests.router.test_engine_inprocess import null_stages, wait_idle


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_run_ahead_gives_the_same_tokens(model_dir: Path, num_stages: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Null model: token (seq_id + tokens output) mod vocab is a function of what the last
    stage holds, and a run-ahead input that went astray would desynchronise the stages'
    histories (a plan error). Which request gets which sequence id depends on the order the
    server takes them in, so each output is checked against its own sequence id. Run
    ahead at the configured depth, paced as deep as it goes (a budget no pace misses: the
    depth goes to twice --run-ahead-depth), and not at all.

    The pace measures only intervals while steps are out (a busy pipeline). Two or three
    stages always are; one null stage often answers everything sent before the core sends
    more, and then the depth rightly stays at its base: the depth expected follows the
    busy intervals the pace saw."""
    depths: list[int] = []
    busy = [0, False]  # intervals measured while busy; the last answer left steps out
    answered = RunAheadPace.answered

    def noting(pace: RunAheadPace, now: float, still_outstanding: bool,
               count: int = 1) -> None:
        answered(pace, now, still_outstanding, count)
        busy[0] += bool(busy[1])
        busy[1] = still_outstanding
        depths.append(pace.scheduler.run_ahead_depth)

    monkeypatch.setattr(RunAheadPace, "answered", noting)

    async def tokens(run_ahead: bool, budget_ms: float) -> list[list[int]]:
        async with in_process_mesh(null_stages(model_dir, num_stages), run_ahead=run_ahead,
                                   run_ahead_budget_ms=budget_ms) as mesh, \
                mesh.client() as client:
            outs = await asyncio.gather(*(
                client.complete(prompt=f"request {i}", max_tokens=24 + i, ignore_eos=True,
                                request_id=f"r{i}") for i in range(6)))
            await wait_idle(client, mesh.stage_sequences)
            return [o.token_ids[0] for o in outs]

    for run_ahead, budget_ms, deepest in ((True, 0.0, 4), (True, 1e6, 8), (False, 0.0, 1)):
        depths.clear()
        busy[:] = [0, False]
        outs = asyncio.run(tokens(run_ahead, budget_ms))
        if budget_ms > 0:
            assert num_stages == 1 or busy[0] >= MIN_INTERVALS, busy
            deepest = deepest if busy[0] >= MIN_INTERVALS else 4
        assert [len(t) for t in outs] == list(range(24, 30))  # max_tokens, exactly
        assert sorted(t[0] for t in outs) == list(range(1, 7))  # sequence ids 1..6
        assert all(t == list(range(t[0], t[0] + len(t))) for t in outs)
        assert max(depths, default=1) == deepest, (run_ahead, budget_ms, set(depths), busy)


@pytest.mark.parametrize(("num_stages", "micro_batches"), [(2, 1), (3, 1), (3, 2)])
def test_fewer_micro_batches_than_stages_give_the_same_tokens(
        model_dir: Path, num_stages: int, micro_batches: int) -> None:
    """As stages that share a GPU run: a step planned on the one before it (run-ahead gap
    1 or 2 over 2-3 stages), so stage 0 waits for tokens sampled one step earlier. Token
    checks as `test_run_ahead_gives_the_same_tokens`; KV back to idle everywhere."""
    async def run() -> list[list[int]]:
        async with in_process_mesh(null_stages(model_dir, num_stages),
                                   micro_batches=micro_batches) as mesh, \
                mesh.client() as client:
            assert (await client.model_info()).micro_batches == micro_batches
            outs = await asyncio.gather(*(
                client.complete(prompt=f"request {i}", max_tokens=24 + i, ignore_eos=True,
                                request_id=f"r{i}") for i in range(6)))
            await wait_idle(client, mesh.stage_sequences)
            return [o.token_ids[0] for o in outs]

    outs = asyncio.run(run())
    assert [len(t) for t in outs] == list(range(24, 30))
    assert sorted(t[0] for t in outs) == list(range(1, 7))
    assert all(t == list(range(t[0], t[0] + len(t))) for t in outs)


@pytest.mark.slow
@pytest.mark.parametrize("run_ahead", [True, False])
def test_default_model_stop_strings_end_choices_with_and_without_run_ahead(
        model_dir: Path, run_ahead: bool) -> None:
    """A stop string found by the front ends the choice; with run-ahead the core has already
    planned the next token, which must be discarded, and the blocks still come back."""
    configs = stage_configs(model_dir, 2, num_blocks=128)

    async def run() -> None:
        async with in_process_mesh(configs, run_ahead=run_ahead) as mesh, \
                mesh.client() as client:
            full = await client.complete(prompt="The capital of France is", max_tokens=24,
                                         temperature=0.0, ignore_eos=True)
            text = full.texts[0]
            stop = text.split()[2]  # a word in the middle of the greedy continuation
            cut = await client.complete(prompt="The capital of France is", max_tokens=24,
                                        temperature=0.0, ignore_eos=True, stop=[stop])
            assert cut.finish_reasons == ["stop"]
            assert cut.texts[0] == text[:text.index(stop)]
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())
