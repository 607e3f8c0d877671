"""The torch engine's GPU paths that a CPU can check (issue 24 §2b and the peer-pool check):
the KV pool sized after a profile run (pure rule; the profile run's plumbing against a
fake of the CUDA allocator statistics), the refusal of more than one device per worker,
and the pattern-copy check of a peer's pool when it is attached."""
from __future__ import annotations

import pytest
import torch

from appliance.engines.messages import (
    Decode, KvImported, Prefill, PrefillDone, SamplingParams, Tokens,
)
from appliance.engines.torch_engine import (
    MemoryPlan, build_torch_engine, kv_pool_budget, profile_activation,
)
from appliance.engines.loader import load_model
from appliance.worker.spec import WorkerSpec

torch.set_num_threads(1)
GiB = 1 << 30


def test_larger_activation_peak_gives_a_smaller_pool():
    total, used = 80 * GiB, 18 * GiB            # an H100, 16 GB of weights + context
    small = kv_pool_budget(total, used, 1 * GiB, 0.9)
    large = kv_pool_budget(total, used, 9 * GiB, 0.9)
    assert small == int(80 * GiB * 0.9) - 19 * GiB
    assert large == small - 8 * GiB and large < small
    assert kv_pool_budget(total, used, 60 * GiB, 0.9) == 0          # never negative
    # What the pool used to get (90% of the free memory, no activation reserve) is more
    # than the device can hold once a full batch runs.
    old = int((total - used) * 0.9)
    assert old + used + 9 * GiB > total * 0.9 and large + used + 9 * GiB <= total * 0.9


class FakeCudaStats:
    """torch.cuda's allocator statistics, as profile_activation uses them. The 'device'
    allocates 1 KiB per prompt token and 100 KiB per logits row during a forward."""

    def __init__(self, model):
        self.calls: list[str] = []
        self.allocated = 5000
        self.peak = self.allocated
        forward = model.forward

        def spy(ids, pos, batch, kv):
            self.calls.append(f"forward {len(batch.seq_lens_q)}x{ids.numel()}")
            self.peak = max(self.peak, self.allocated + ids.numel() * 1024
                            + len(batch.seq_lens_q) * 100 * 1024)
            return forward(ids, pos, batch, kv)

        model.forward = spy

    def synchronize(self):
        self.calls.append("sync")

    def reset_peak_memory_stats(self):
        self.calls.append("reset")
        self.peak = self.allocated

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def empty_cache(self):
        self.calls.append("empty")


def test_profile_run_measures_a_full_batch_both_ways(tiny_model):
    model = load_model(tiny_model)
    stats = FakeCudaStats(model)
    peak = profile_activation(model, tokens=96, seqs=8, block_size=16, stats=stats)
    forwards = [c for c in stats.calls if c.startswith("forward")]
    assert forwards == ["forward 1x96", "forward 8x96"]
    # Each forward is measured from a reset, after a sync, and its memory given back.
    for i, c in enumerate(stats.calls):
        if c.startswith("forward"):
            assert stats.calls[i - 1] == "reset" and stats.calls[i + 1] == "sync"
    assert stats.calls[-1] == "empty"
    assert peak == 96 * 1024 + 8 * 100 * 1024          # the larger of the two


def test_memory_plan_is_reported_in_one_line():
    plan = MemoryPlan(total_bytes=80 * GiB, mem_fraction=0.9, weights_bytes=16 * GiB,
                      used_bytes=18 * GiB, peak_activation_bytes=3 * GiB, profile_tokens=8192,
                      kv_bytes=51 * GiB, kv_blocks=26112, attention="flashinfer")
    line = plan.describe("decode0")
    assert "\n" not in line
    for part in ("80.0 GiB x 0.9", "weights 16.00 GiB", "peak activation 3.00 GiB",
                 "8192 tokens", "KV pool 51.00 GiB (26112 blocks)", "attention: flashinfer"):
        assert part in line, (part, line)


def test_more_than_one_gpu_per_torch_worker_is_refused(tiny_model):
    spec = WorkerSpec(worker="prefill0", role="prefill", engine="torch",
                      devices=["gpu0", "gpu1"], device_kind="gpu", model_dir=str(tiny_model))
    with pytest.raises(ValueError, match="one GPU per worker .* given 2: use tp = 1"):
        build_torch_engine(spec, tiny_model)


# --------------------------------------------------------------------------- canary


def _engine(tiny_model, worker, role):
    spec = WorkerSpec(worker=worker, role=role, engine="torch", devices=["cpu"],
                      device_kind="cpu", model_dir=str(tiny_model),
                      kv_cache_bytes=64 * 2 * 4 * 16 * 2 * 64 * 4, max_batch_tokens=512)
    return build_torch_engine(spec, tiny_model)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = [0] + [(13 * j) % 3000 + 5 for j in range(30)]


def _handoff(pre, dec):
    assert pre.add(Prefill("r", PROMPT, GREEDY, handoff=True)) == []
    (done,) = [e for e in pre.step() if isinstance(e, PrefillDone)]
    assert dec.add(Decode("r", PROMPT, done.first_token, GREEDY, done.handle)) == []
    events = []
    while dec.has_work():
        events += dec.step()
    pre.release("r")
    return [done.first_token] + [t for e in events if isinstance(e, Tokens) for t in e.tokens], \
        [e for e in events if isinstance(e, KvImported)]


def test_peer_pool_passes_the_pattern_copy_check_and_serves(tiny_model):
    pre, dec = _engine(tiny_model, "prefill0", "prefill"), _engine(tiny_model, "decode0", "decode")
    dec.attach_peer(pre.worker, pre.peer_handle())
    assert pre.worker in dec._peers and not dec._peer_errors
    tokens, imported = _handoff(pre, dec)
    assert len(tokens) == 8 and imported and dec.kv_recomputes == 0


def test_peer_pool_that_fails_the_pattern_copy_check_is_not_read(tiny_model, capfd):
    """A copy path that corrupts data (here: the canary the copy reads is wrong) is found
    when the pool is attached; its handoffs are then recomputed, never imported."""
    ref_pre = _engine(tiny_model, "prefill9", "prefill")
    ref_dec = _engine(tiny_model, "decode9", "decode")
    ref_dec.attach_peer(ref_pre.worker, ref_pre.peer_handle())
    want, _ = _handoff(ref_pre, ref_dec)

    pre, dec = _engine(tiny_model, "prefill0", "prefill"), _engine(tiny_model, "decode0", "decode")
    pre.kv[1, 0, -1, 3, 0, 5] += 1.0                  # one value of the canary block
    dec.attach_peer(pre.worker, pre.peer_handle())
    err = capfd.readouterr().err
    assert "KV pool of prefill0 refused: pattern-copy check failed: 1 of" in err
    assert pre.worker not in dec._peers
    got, imported = _handoff(pre, dec)
    assert got == want                                 # recomputed here, correct
    assert dec.kv_recomputes == 1 and imported         # and the source told to free


def test_gpu_workers_never_get_expandable_segments():
    """The daemon's environment for a GPU worker forces expandable_segments off in both
    names torch reads, keeping the operator's other allocator options; CPU workers get
    no allocator setting."""
    from appliance.daemon.workers import worker_env

    gpu = WorkerSpec(worker="decode0", role="decode", engine="torch", devices=["gpu1"],
                     device_kind="gpu", model_dir="/m", device_uuids=["GPU-b"],
                     peer_uuids=["GPU-a"])
    base = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, max_split_size_mb:128",
            "PYTORCH_ALLOC_CONF": "expandable_segments:True", "HOME": "/root"}
    env = worker_env(gpu, base)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:False"
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-a" and env["HOME"] == "/root"
    assert worker_env(gpu, {})["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert "PYTORCH_ALLOC_CONF" not in worker_env(gpu, {})
    cpu = WorkerSpec(worker="decode0", role="decode", engine="torch", devices=["cpu0"],
                     device_kind="cpu", model_dir="/m")
    assert worker_env(cpu, base) == {**base, "OMP_WAIT_POLICY": "PASSIVE"}
