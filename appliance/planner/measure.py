"""`applianced profile`: measure a profile on the real engine (a short sweep).

Builds one engine exactly as a worker would (`worker.engine_factory.build_engine`), in
this process, and times its own iterations (`IterationRecord.wall_s`): prefill steps of
growing batched tokens, then decode steps at a grid of batch sizes and contexts. Each
point is the median of a few repeats after a warm-up. Torch is imported here only.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

from appliance.engines.messages import IterationRecord, Prefill, SamplingParams
from appliance.planner.profiles import PREFILL_PROMPT_TOKENS, Profile

QUICK = {"prefill": (16, 64, 256, 1024), "batches": (1, 4, 16), "contexts": (64, 512)}
FULL = {"prefill": (16, 32, 64, 128, 256, 512, 1024, 2048), "batches": (1, 2, 4, 8, 16, 32),
        "contexts": (64, 256, 1024)}


def _prompts(total: int, rng, vocab: int) -> list[list[int]]:
    """Random prompts of at most PREFILL_PROMPT_TOKENS tokens summing to `total` (random
    first blocks: no prefix-cache hits)."""
    out, left = [], total
    while left > 0:
        n = min(PREFILL_PROMPT_TOKENS, left)
        out.append([rng.randrange(100, vocab) for _ in range(n)])
        left -= n
    return out


def _walls(events) -> list[tuple[str, float]]:
    return [(e.phase, e.wall_s) for e in events if isinstance(e, IterationRecord)]


def measure_profile(spec, model_spec, device: str, repeats: int = 3, quick: bool = False,
                    progress=None) -> Profile:
    """Sweep the engine `spec` (a WorkerSpec of role agg) builds."""
    from appliance.worker.engine_factory import build_engine
    grid = QUICK if quick else FULL
    spec = replace(spec, role="agg", max_batch_tokens=max(grid["prefill"]) + 1,
                   max_seqs=max(grid["batches"]) + 1, reserve_ratio=0.0)
    engine = build_engine(spec)
    say = progress or (lambda line: None)
    import json
    import random
    from pathlib import Path
    vocab = int(json.loads((Path(spec.model_dir) / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    rid = iter(range(10**9))

    def add(name: str, prompt: list[int], max_tokens: int) -> None:
        for ev in engine.add(Prefill(name, prompt, SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True), handoff=False)):
            raise ValueError(f"profile: the engine refused a request: {ev.message}")

    def run_prefill(total: int) -> float:
        for p in _prompts(total, rng, vocab):
            add(f"p{next(rid)}", p, 1)
        walls = []
        while engine.has_work():
            walls += [w for ph, w in _walls(engine.step()) if ph == "prefill"]
        return sum(walls)

    run_prefill(64)                      # warm-up: first calls pay for lazy init
    prefill = []
    todo = len(grid["prefill"]) + len(grid["batches"]) * len(grid["contexts"])
    done = 0
    for t in grid["prefill"]:
        prefill.append([t, statistics.median(run_prefill(t) for _ in range(repeats))])
        done += 1
        say(f"[{done}/{todo}] prefill {t} tokens: {prefill[-1][1] * 1000:.1f} ms")
    decode = []
    for b in grid["batches"]:
        for c in grid["contexts"]:
            names = [f"d{next(rid)}" for _ in range(b)]
            for name in names:
                add(name, [rng.randrange(100, vocab) for _ in range(c)], repeats + 3)
            walls = []
            while engine.has_work():
                walls += [w for ph, w in _walls(engine.step()) if ph == "decode"]
            # Steps where all b sequences decoded: skip the first (warm-up), keep the rest.
            steady = walls[1:repeats + 1] or walls
            decode.append([b, c, statistics.median(steady)])
            done += 1
            say(f"[{done}/{todo}] decode batch {b} at context {c}: {decode[-1][2] * 1000:.1f} ms")
    blocks = engine.blocks.num_blocks * engine.blocks.block_size
    return Profile(model=model_spec.name, device=device, tp=1, source="measured",
                   created=time.time(), prefill=prefill, decode=decode,
                   kv_capacity_tokens=blocks,
                   note=f"{spec.engine} engine on {device}, {spec.cpu_threads} thread(s), "
                        f"median of {repeats}")
