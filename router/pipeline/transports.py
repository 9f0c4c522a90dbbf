"""Which data-plane transport each hop between two neighbouring stages uses.

The router's `--transport` asks for one: "auto" (CUDA IPC where two stages on one host can
share GPU memory, else a Unix-domain socket between two stages of one host, NCCL between GPU
stages on different hosts, TCP elsewhere), "tcp" everywhere, "unix", "cuda_ipc" or "nccl"
everywhere (an error naming the stage when a hop cannot). The feedback link (last stage ->
first stage: a few host ints per step) is a Unix-domain socket where those two stages share
a host and both offer it, unless "tcp" is asked for; else TCP (`choose_feedback_transport`).

"One host" is the same non-empty host_id (host name and boot id): two processes of one
machine, or two containers of one pod, which share a network namespace, where an abstract
Unix-domain name reaches.
"""

from __future__ import annotations

from router.pipeline.shape import PipelineError, StageInfo

TCP = "tcp"
UNIX = "unix"
CUDA_IPC = "cuda_ipc"
NCCL = "nccl"
AUTO = "auto"
TRANSPORT_CHOICES = (AUTO, TCP, UNIX, CUDA_IPC, NCCL)  # what `--transport` accepts


def choose_transport(up: StageInfo, down: StageInfo, wanted: str) -> str:
    """The transport of the hop `up` -> `down` (neighbours, in pipeline order).

    wanted: "auto" -> "cuda_ipc" when both stages offer it and report the same non-empty
    host_id; else "unix" when both offer that and report the same non-empty host_id; else
    "nccl" when both offer it and report two different non-empty host_ids; else "tcp".
    "tcp" -> "tcp"; "unix" and "cuda_ipc" -> that when it holds; "nccl" -> "nccl" when both
    offer it, on any hosts (two GPUs of one host without IPC between them; NCCL refuses two
    ranks on one GPU, which the link then reports).

    Raises:
        PipelineError: "unix", "cuda_ipc" or "nccl" was asked for and this hop cannot have
            it (naming the stage(s) that do not offer it, or the two hosts).
        ValueError: `wanted` is none of TRANSPORT_CHOICES.
    """
    if wanted not in TRANSPORT_CHOICES:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, "
                         f"got {wanted!r}")
    if wanted == TCP:
        return TCP
    if wanted != AUTO:
        why = _why_not_nccl(up, down) if wanted == NCCL else _why_not_same_host(up, down,
                                                                                 wanted)
        if why is not None:
            raise PipelineError(f"--transport {wanted}: the hop from stage {up.stage_index} "
                                f"to stage {down.stage_index} cannot use {wanted}: {why}")
        return wanted
    for kind in (CUDA_IPC, UNIX):
        if _why_not_same_host(up, down, kind) is None:
            return kind
    if (_why_not_nccl(up, down) is None and up.host_id and down.host_id
            and up.host_id != down.host_id):
        return NCCL
    return TCP


def choose_feedback_transport(last: StageInfo, first: StageInfo, wanted: str) -> str:
    """The transport of the run-ahead feedback link `last` -> `first`: "unix" where the two
    stages offer it and share a host, unless `wanted` is "tcp"; else "tcp"."""
    if wanted != TCP and _why_not_same_host(last, first, UNIX) is None:
        return UNIX
    return TCP


def _lacking(up: StageInfo, down: StageInfo, kind: str) -> str | None:
    """Which of the two stages do not offer `kind` (None: both do)."""
    lacking = [s for s in (up, down) if kind not in s.transports]
    if not lacking:
        return None
    return "; ".join(f"stage {s.stage_index} does not offer it (it offers "
                     f"{', '.join(s.transports)})" for s in lacking)


def _why_not_nccl(up: StageInfo, down: StageInfo) -> str | None:
    """None when the two stages can link over NCCL, else why not."""
    return _lacking(up, down, NCCL)


def _why_not_same_host(up: StageInfo, down: StageInfo, kind: str) -> str | None:
    """None when the two stages can link over `kind` ("cuda_ipc", "unix": both offer it,
    on one host), else why not."""
    lacking = _lacking(up, down, kind)
    if lacking:
        return lacking
    unknown = [s for s in (up, down) if not s.host_id]
    if unknown:
        return "; ".join(f"stage {s.stage_index} does not report its host" for s in unknown)
    if up.host_id != down.host_id:
        return f"they run on different hosts ({up.host_id!r} and {down.host_id!r})"
    return None


def describe_hops(hops: list[str]) -> str:
    """The hops for a log line: "hops: tcp" when all are alike, else each one
    ("hops: 0->1 cuda_ipc, 1->2 nccl"); "no hops" for a single stage."""
    if not hops:
        return "no hops"
    if len(set(hops)) == 1:
        return f"hops: {hops[0]}"
    return "hops: " + ", ".join(f"{i}->{i + 1} {kind}" for i, kind in enumerate(hops))
