"""What the stages report at connect, and the pipeline's shape and capacity derived from it."""

from __future__ import annotations

from dataclasses import dataclass


class PipelineError(RuntimeError):
    """The stages do not form a usable pipeline, or one failed."""


@dataclass(frozen=True)
class StageInfo:
    """One stage's Describe answer: identity, capacity and live usage.

    num_kv_blocks: blocks of its pool the router may hand out.
    max_num_batched_tokens: the largest step (tokens computed) it sized its activations for.
    max_num_seqs: the most sequences one step may compute.
    transports: the data-plane transports it offers ("tcp", "unix", "cuda_ipc", "nccl"); a stage
        that reports none offers "tcp".
    host_id: which machine it runs on (host name and boot id): two stages with the same
        non-empty host_id share a host; "" = not reported (an older stage).
    device_id: what it computes on (a GPU's UUID, or a host's set of CPU cores): two stages
        with the same non-empty device_id take turns on it; "" = not reported (an older
        stage), counted as a device of its own.
    """

    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    device: str
    dtype: str
    tp_size: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    model_impl: str
    kv_blocks_used: int = 0
    num_sequences: int = 0
    transports: tuple[str, ...] = ("tcp",)
    standby: bool = False  # a standby stage, not assigned a place yet (holds no layers)
    host_id: str = ""
    steps: int = 0  # live figures (Describe at the time): steps run, recent step time, bubble
    step_time_ms: float = 0.0
    bubble_fraction: float = 0.0
    device_id: str = ""


@dataclass(frozen=True)
class PipelineShape:
    """The stages as one pipeline. Capacity is the minimum over stages, so a block id, a step
    size or a batch size the router plans fits every one of them.

    limiting_stage: for each capacity field, the index of a stage that set the minimum (to
    name it in errors).
    num_devices: the devices the stages compute on, which can work at once: stages that
    report one device (the same device_id: one GPU, or one host's cores) count once; a stage
    that reports none counts alone.
    """

    num_stages: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    tp_size: int
    dtype: str
    model_impl: str
    max_num_batched_tokens: int
    max_num_seqs: int
    layer_ranges: tuple[tuple[int, int], ...]
    limiting_stage: dict[str, int]
    num_devices: int = 1

    def covers(self, other: PipelineShape) -> str | None:
        """None when this shape can run everything `other` (the one the scheduler was built
        for) plans; else what falls short. A restarted stage must not shrink the pipeline."""
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
            have, need = getattr(self, name), getattr(other, name)
            if have < need:
                return (f"stage {self.limiting_stage[name]} now reports {name} {have}, the "
                        f"pipeline was started with {need}")
        if (self.block_size, self.num_stages) != (other.block_size, other.num_stages):
            return (f"block size / stages changed from {other.block_size}/{other.num_stages} "
                    f"to {self.block_size}/{self.num_stages}")
        return None


def check_shape(infos: list[StageInfo]) -> PipelineShape:
    """The stages must be 0..P-1 of one P-stage pipeline with contiguous layer ranges and one
    block size. Raises PipelineError naming the first stage that does not fit."""
    p = len(infos)
    for i, info in enumerate(infos):
        if info.stage_index != i or info.num_stages != p:
            raise PipelineError(f"stage at position {i} reports itself as stage "
                                f"{info.stage_index} of {info.num_stages}, expected {i} of {p}")
        if i and info.layer_start != infos[i - 1].layer_end:
            raise PipelineError(f"stage {i} starts at layer {info.layer_start}, but stage "
                                f"{i - 1} ends at {infos[i - 1].layer_end}")
        if info.block_size != infos[0].block_size:
            raise PipelineError(f"stage {i} has block size {info.block_size}, stage 0 has "
                                f"{infos[0].block_size}")
    limiting = {name: _smallest(infos, name)
                for name in ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs")}
    first = infos[0]
    return PipelineShape(
        num_stages=p, block_size=first.block_size, vocab_size=first.vocab_size,
        tp_size=first.tp_size, dtype=first.dtype, model_impl=first.model_impl,
        num_kv_blocks=infos[limiting["num_kv_blocks"]].num_kv_blocks,
        max_num_batched_tokens=infos[limiting["max_num_batched_tokens"]].max_num_batched_tokens,
        max_num_seqs=infos[limiting["max_num_seqs"]].max_num_seqs,
        layer_ranges=tuple((i.layer_start, i.layer_end) for i in infos),
        limiting_stage=limiting,
        num_devices=len({info.device_id or f"stage {i}" for i, info in enumerate(infos)}))


def _smallest(infos: list[StageInfo], name: str) -> int:
    """The index of the first stage with the smallest `name`."""
    values = [int(getattr(info, name)) for info in infos]
    return values.index(min(values))
