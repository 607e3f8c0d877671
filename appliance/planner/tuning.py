"""The prefill token budget from a profile: what `engine.max_batch_tokens = 0` means.

A prefill step's throughput rises with its batched tokens until the device saturates;
past that knee a bigger batch only makes every prompt in it wait longer for its first
token (NVIDIA's tuning rule for TensorRT-LLM's max_num_tokens). The knee is read from
the best profile there is for the worker's device: one measured on this box by
`applianced profile`, else the roofline's for a catalogue (or simulated) GPU; a device
with neither (the CPU before anyone profiled it) keeps the historical default.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.planner.profiles import load_profile, simulated_profile

DEFAULT_MAX_BATCH_TOKENS = 8192
# A torch CPU worker's prefill step budget (engine.cpu_prefill_step_ms > 0, the default)
# when no measured profile says how long a step takes: on the 2-core development machine,
# quiet, 512 served as many requests per second as 256 at C = 8 and more at C = 32, and more
# than 1,024 and 8,192 at both (docs/benchmarks.md, "Against vLLM's CPU build"); a
# 512-token bf16 step of the 82m model takes about the default 500 ms there.
CPU_DEFAULT_STEP_TOKENS = 512


def cpu_step_tokens(configured: int, step_ms: int, profile=None, *, block_size: int = 16) -> int:
    """A torch CPU worker's prefill token budget: `configured` (engine.max_batch_tokens or
    its auto value) capped so one prefill step takes about `step_ms` (engine.cpu_prefill_step_ms)
    by the worker's measured `profile`, or `CPU_DEFAULT_STEP_TOKENS` without one. Why: the
    prefill worker hands a prompt to the decode worker only when its step ends, so on a
    few cores one long step leaves the decode side idle while a wave of prompts prefills,
    and every prompt of the wave waits for the whole step's first tokens. A prompt longer
    than the budget still runs (alone, as the scheduler does for any budget)."""
    if step_ms <= 0:
        return configured
    if profile is None:
        return min(configured, CPU_DEFAULT_STEP_TOKENS)
    from appliance.engines.fair_queue import chunk_for_step_time
    return chunk_for_step_time(profile.prefill_s, step_ms / 1000, align=block_size,
                               lo=block_size, hi=max(block_size, configured))


@dataclass(frozen=True, slots=True)
class TokenBudget:
    tokens: int
    source: str          # "measured" | "simulated" | "default"
    device: str
    why: str

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "source": self.source, "device": self.device,
                "why": self.why}


def token_budget(model, gpu, tp: int, profile_dir: Path | None, *, mem_fraction: float = 0.9,
                 floor: int = 0) -> TokenBudget:
    """The knee for `model` (ModelSpec) on `tp` of `gpu` (GpuSpec, None for the CPU).
    `floor`: an engine that cannot split a prompt across steps (TensorRT-LLM without
    chunked context) needs at least the longest prompt, whatever the knee says."""
    device = gpu.name if gpu is not None else "cpu"
    profile = load_profile(profile_dir, model.name, device, tp)
    if profile is None and gpu is not None:
        profile = simulated_profile(model, gpu, tp, mem_fraction)
    if profile is None:
        return TokenBudget(DEFAULT_MAX_BATCH_TOKENS, "default", device,
                           f"no profile for {model.name} on {device} (tp {tp}); "
                           "`applianced profile` measures one")
    knee = profile.prefill_knee_tokens()
    why = (f"knee of the {profile.source} prefill profile of {model.name} on {device} "
           f"(tp {tp}): {knee} tokens reach 90% of the best prefill throughput")
    if floor > knee:
        why += f"; raised to {floor}, the longest prompt, which this engine cannot split"
    return TokenBudget(max(knee, floor), profile.source, device, why)


def batch_tokens_json(configured: int, workers: dict[str, tuple[str, int]],
                      budgets: dict[str, TokenBudget]) -> dict:
    """What `/admin/v1/status` and the plan report: the configured value (0 = auto), what
    the engines run with (the prefill side's, the one that bounds TTFT), and per worker.
    `workers`: name -> (role, tokens)."""
    lead = next((w for w, (role, _) in workers.items() if role in ("prefill", "agg")),
                next(iter(workers), None))
    out = {"configured": configured, "value": workers[lead][1] if lead else configured,
           "workers": {w: t for w, (_, t) in workers.items()}}
    if configured > 0 and out["value"] < configured:
        out.update(source="cpu step", why=f"engine.max_batch_tokens = {configured} capped by "
                   "engine.cpu_prefill_step_ms on this CPU worker")
    elif configured > 0:
        out.update(source="configured", why="engine.max_batch_tokens in the config")
    elif lead in budgets:
        out.update(source=budgets[lead].source, why=budgets[lead].why)
    return out
