"""One stage process's configuration, composed once at start-up and passed down."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from stage_worker.dataplane.compression import CHOICES as COMPRESSION_CHOICES

MODEL_IMPLS = ("auto", "llama", "null")
TRANSPORT_CHOICES = ("auto", "tcp", "unix", "cuda_ipc", "nccl")
QUANTIZATION_CHOICES = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class StageConfig:
    """Everything a stage leader (and its TP ranks) needs to start.

    Attributes:
        model_dir: HF-layout model directory.
        stage_index / num_stages: this stage's place in the pipeline.
        layer_override: explicit layer count per stage (all stages must agree), or None.
        tp_size: tensor-parallel ranks in this stage; the leader spawns ranks 1..tp_size-1.
        device: "cpu", "cuda" or "cuda:N" (TP rank r uses cuda:N+r).
        dtype: "auto", "float32", "bfloat16" or "float16".
        block_size / num_blocks / kv_cache_bytes: the KV pool (num_blocks fixes it).
        gpu_memory_utilization: this stage's share of its GPU (weights, activations, KV).
        model_impl: "auto" or "llama" (the torch Llama-family model of `model_dir`), or
            "null" (no model compute, no weights: the control-plane benchmark W6).
        max_num_batched_tokens: the largest step (tokens computed) the stage sizes its
            activations for and accepts.
        max_num_seqs: the most sequences one step may compute (decode graphs are captured
            up to it, at most 256).
        host / port: the gRPC control listener (port 0 picks one).
        dataplane_host: the address the data-plane listener binds; "" binds the host the
            router reaches this stage by (the host of its gRPC address).
        dataplane_port: the data-plane listener's port (0 picks one; a fixed one lets a
            service mesh or a NetworkPolicy name it).
        dataplane_advertise: the host the upstream stage dials; "" means the bound host, or
            the router's name for this stage when the bound host is a wildcard.
        tp_init_port: rendezvous port of the TP group on 127.0.0.1 (0 picks one).
        metrics_port: serve Prometheus metrics at http://host:port/metrics (0 picks one);
            None serves none.
        otlp_traces_endpoint: where OpenTelemetry spans go (`foundation.tracing`); None =
            the standard environment's, else no tracing.
        step_timeout_s: longest wait for a step's activations from upstream.
        enforce_eager: never replay CUDA graphs for decode steps (debugging, A/B runs).
        quantization: "none", or "fp8": the decoder layers' projections stored as e4m3
            with per-output-feature scales after loading (`kernels.fp8_linear`; the FP8
            kernels need a CUDA device of compute capability 8.9 or more, elsewhere the
            torch reference runs: memory saved, no speed).
        kv_cache_dtype: "auto" (the KV pool in the model's dtype) or "fp8" (e4m3 at unit
            scale, values saturated to +-448: twice the blocks in the same memory, half the
            bytes a decode step's attention reads; `StageRunnerConfig.kv_cache_dtype`).
        activation_compression: the form of the activations this stage sends downstream:
            "none", "bf16", "fp16" or "int8" (`stage_worker.dataplane.compression`).
        transport: the data-plane transports the stage offers for activation links: "auto"
            (``tcp``, ``unix`` on Linux, and ``cuda_ipc`` and ``nccl`` on a CUDA device with
            cupy, and its NCCL, installed), "tcp", "unix", "cuda_ipc" or "nccl" (only that
            one; refused at start where it cannot work). The router picks per hop among what
            both ends offer.
        dataplane_tls_cert / dataplane_tls_key / dataplane_tls_ca: PEM files; all three turn
            TLS on for the stage's TCP data-plane links (`DataPlaneTls`): this stage's
            certificate and key (presented when it accepts a link), and the CA that signed
            the other stages' certificates (checked with the dialled name when it connects).
            "" = plaintext.
        standby: hold no layers until the router assigns this process a failed stage's
            place (`stage_worker.standby`); stage_index, num_stages, the layer override and
            the capacity fields are then the assignment's. TP size 1.
    """

    model_dir: Path
    stage_index: int = 0
    num_stages: int = 1
    layer_override: tuple[int, ...] | None = None
    tp_size: int = 1
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    model_impl: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    host: str = "127.0.0.1"
    port: int = 0
    dataplane_host: str = ""
    dataplane_port: int = 0
    dataplane_advertise: str = ""
    tp_init_port: int = 0
    step_timeout_s: float = 60.0
    enforce_eager: bool = False
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    activation_compression: str = "none"
    transport: str = "auto"
    dataplane_tls_cert: str = ""
    dataplane_tls_key: str = ""
    dataplane_tls_ca: str = ""
    standby: bool = False
    metrics_port: int | None = None
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage index {self.stage_index} outside 0..{self.num_stages - 1}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.dataplane_port <= 65535:
            raise ValueError(f"dataplane_port must be in [0, 65535], got {self.dataplane_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.activation_compression not in COMPRESSION_CHOICES:
            raise ValueError(f"activation_compression must be one of "
                             f"{', '.join(COMPRESSION_CHOICES)}, got "
                             f"{self.activation_compression!r}")
        tls = (self.dataplane_tls_cert, self.dataplane_tls_key, self.dataplane_tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("data-plane TLS needs the stage's certificate and key "
                             "(--tls-cert, --tls-key) and --dataplane-tls-ca")
        if self.standby and self.tp_size != 1:
            raise ValueError("a standby stage runs at TP size 1 (--tp 1)")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, got "
                             f"{self.transport!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got "
                             f"{self.model_impl!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_json(self) -> str:
        """The config as JSON (how the leader hands it to its TP rank processes; no pickle)."""
        return json.dumps({k: (str(v) if isinstance(v, Path) else v)
                           for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> StageConfig:
        doc = json.loads(text)
        doc["model_dir"] = Path(doc["model_dir"])
        if doc.get("layer_override") is not None:
            doc["layer_override"] = tuple(doc["layer_override"])
        return cls(**doc)
