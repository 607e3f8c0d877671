"""What the daemon tells a worker process to be. Crosses the process boundary as JSON
on the command line, so a frozen single binary can start its own workers."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class WorkerSpec:
    worker: str                     # "prefill0", "decode1", "agg0"
    role: str                       # "prefill" | "decode" | "agg"
    engine: str                     # "sim" | "torch" | "trtllm"
    devices: list[str]              # device ids from the partition plan
    device_kind: str                # "gpu" | "cpu" | "sim"
    model_dir: str
    gpu_name: str | None = None     # catalogue name (sim and gpu)
    device_uuids: list[str] = field(default_factory=list)
    peer_uuids: list[str] = field(default_factory=list)   # GPUs of workers we swap KV with
    cpu_cores: list[int] = field(default_factory=list)    # CPU ids to pin to; [] = no pinning
    cpu_threads: int = 1            # torch threads of a CPU engine
    model_spec: str | None = None   # simulator shape; None = read model_dir/config.json
    sim_speed: float = 1.0
    block_size: int = 16
    max_batch_tokens: int = 8192
    max_seqs: int = 256
    kv_cache_bytes: int = 1 << 30   # CPU pool budget
    gpu_mem_fraction: float = 0.9
    handoff_timeout_s: float = 30.0
    reserve_ratio: float = 1.0
    prefill_chunk_tokens: int = 0   # > 0: prompts are prefilled in chunks of this many tokens
    dtype: str = "auto"             # torch engine: auto | float32 | bfloat16 | float16
    compile: str = "off"            # torch engine: off | decode (layers.glue)
    cpu_kernels: str = "off"        # torch on the CPU: auto | off (engines.cpu_kernels; the
                                    # daemon passes [engine] cpu_kernels, "auto" by default)
    kernel_dir: str = ""            # where built CPU kernels are cached ("" = ~/.cache/applianced)
    cpu_helper_core: int = -1       # a decode worker's matmuls may borrow this core while it
                                    # idles (the prefill worker's, on a small box); -1: none
    cpu_helper_lender: str = ""     # the worker whose core that is (busy: not borrowed)
    cpu_helper_slot: int = -1       # this borrower's word in the lender's page (core_lending)
    cpu_core_lent: bool = False     # a prefill worker whose core decode workers may borrow
    cpu_lend_fd: int = -1           # the page lender and borrowers share (set at spawn)
    cpu_decode_ride_rows: int = 0   # a CPU decode worker's prompts ride on its decode steps up
                                    # to this many rows in all; -1 = auto, 0 = off
    fair_queuing: bool = True       # tenants' prompts share prefill steps by weight
    fair_chunk_tokens: int = 0      # prompt chunk while tenants share; 0 = the engine's choice
    cluster_peers: list[str] = field(default_factory=list)  # [cluster] peers: KV crosses boxes
    nixl: bool = False              # register the KV pool with a NIXL agent (cluster roles)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        return cls(**json.loads(text))
