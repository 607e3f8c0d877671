"""Fair shares inside a batch (issue 22 §1): a step's shared cost (c0, the weight read)
is split evenly, each entry's own cost by its tokens and context.

The simulator runs here in-process on a virtual clock: the real SimEngine, scheduler
and block manager, with each step's record given the step time the roofline says
(what the engine sleeps at speed 1), so the runs take milliseconds and are exact. The
bound a fair split must meet is computed from the same roofline (StepTimeModel)."""
from __future__ import annotations

import random
import time

import pytest

from appliance.accounting.attribution import Attributor, Calibration, DeviceInfo
from appliance.engines.messages import IterationRecord, Prefill, SamplingParams
from appliance.engines.roofline import DeviceShape, StepTimeModel
from appliance.engines.sim import SimEngine
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import H100_SXM

T0 = 1_700_000_000.0
SPEC = lookup_model_spec("llama-3.1-70b-fp8")
TIMING = StepTimeModel(DeviceShape.from_gpu(H100_SXM, SPEC.weight_bytes), 1, SPEC)
KEY = "llama-3.1-70b-fp8|H100-SXM"


class ClockedSim(SimEngine):
    """The real SimEngine; its sleep advances a virtual clock, and each step's record
    carries that step's simulated time and start."""

    def __init__(self, chunk: int = 0):
        super().__init__(timing=TIMING, vocab_ids=list(range(100, 200)), speed=1.0,
                         worker="w0", devices=("g0",),
                         num_blocks=TIMING.kv_capacity_tokens(0.9) // 16, block_size=16,
                         max_batch_tokens=8192, max_seqs=256, max_context=SPEC.max_context,
                         prefill_chunk_tokens=chunk)
        self.now = T0 + 0.5
        self._slept = 0.0
        self.records: list[IterationRecord] = []

    def _sleep(self, seconds: float) -> None:
        self._slept += seconds

    def run(self) -> None:
        while self.has_work():
            self._slept = 0.0
            for ev in self.step():
                if isinstance(ev, IterationRecord):
                    ev.start, ev.wall_s = self.now, self._slept
                    self.now += self._slept
                    self.records.append(ev)

    def submit(self, rid: str, prompt_len: int, out: int, rng: random.Random) -> None:
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
        assert self.add(Prefill(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                                handoff=False)) == []


def warm_up(eng: ClockedSim, rng: random.Random, waves: int = 30, short=(100, 600)) -> None:
    """Varied batches of both phases, so the fit sees the terms vary independently."""
    for w in range(waves):
        for j in range(rng.randint(1, 3)):
            eng.submit(f"warm{w}L{j}", rng.randint(2000, 7000), rng.randint(5, 30), rng)
        for j in range(rng.randint(1, 12)):
            eng.submit(f"warm{w}S{j}", rng.randint(*short), rng.randint(5, 40), rng)
        eng.run()


def bill(eng: ClockedSim, attributor: Attributor) -> dict[tuple[str, str], float]:
    """Every record through the attributor, every window closed: GPU-s per (request, phase)."""
    for rec in eng.records:
        attributor.add(rec)
    eng.records = []
    out: dict[tuple[str, str], float] = {}
    for w in attributor.close_until(eng.now + 20.0, None):
        for key, (g, _) in w.shares.items():
            out[key] = out.get(key, 0.0) + g
    eng.now = attributor.closed_until + 0.5      # the next run starts in an open window
    return out


def new_attributor() -> Attributor:
    return Attributor([DeviceInfo("g0", "H100-SXM", "sim", True)], "llama-3.1-70b-fp8",
                      10.0, Calibration(min_iterations=20), start=T0)


def test_decode_per_token_cost_of_long_and_short_contexts_is_the_rooflines_ratio():
    """Tenants L (~6k-token contexts) and S (~300) decode side by side in the same
    batches. Per output token, L may pay more than S by at most what the device's own
    step-time model says a step of long contexts costs more than one of short ones at
    that batch size (~1.1× here); spreading the weight read by marginal weight billed
    ~4.7×."""
    rng = random.Random(7)
    eng = ClockedSim()
    acc = new_attributor()
    warm_up(eng, rng)
    bill(eng, acc)
    fit = acc.calibration.describe()[KEY]["decode"]
    assert fit["status"] == "fit" and fit["c0_s"] > 0.5 * fit["mean_step_s"], fit

    for j in range(4):
        eng.submit(f"L{j}", 6000 + 17 * j, 64, rng)
    for j in range(4):
        eng.submit(f"S{j}", 300 + 11 * j, 64, rng)
    eng.run()
    decode_steps = [r for r in eng.records if r.phase == "decode"]
    billed = bill(eng, acc)

    tokens = {"L": 0, "S": 0}
    bound = 1.0
    shared = 0
    for r in decode_steps:
        ctx = {"L": [], "S": []}
        for rid, _, c in r.entries:
            ctx[rid[0]].append(c)
            tokens[rid[0]] += 1
        if ctx["L"] and ctx["S"]:
            shared += 1
            n = len(r.entries)
            long_c = sum(ctx["L"]) / len(ctx["L"])
            short_c = sum(ctx["S"]) / len(ctx["S"])
            bound = max(bound, TIMING.decode_s([long_c] * n) / TIMING.decode_s([short_c] * n))
    assert shared >= 60 and shared == len(decode_steps)      # the same batches throughout
    per_token = {t: sum(g for (rid, ph), g in billed.items() if rid[0] == t and ph == "decode")
                 / tokens[t] for t in ("L", "S")}
    ratio = per_token["L"] / per_token["S"]
    assert 1.0 < bound < 1.3
    print(f"per-token decode cost L/S: {ratio:.3f}, roofline bound {bound:.3f}")
    assert 1.0 <= ratio <= bound * 1.01, (ratio, bound, per_token)
    # and the split is whole: the measured decode time, no more, no less
    assert sum(g for (_, ph), g in billed.items() if ph == "decode") == pytest.approx(
        sum(r.wall_s for r in decode_steps), rel=1e-9)


def test_chunked_prefill_is_billed_like_unchunked():
    """The same 6,000-token prompt arriving while 24 sequences decode: unchunked (its
    own prefill step) and in 512-token chunks riding on the decode steps. Its prefill
    bill differs by less than 5%: every chunk pays its own attention triangle
    new·(ctx − new/2) and the steps' shared part is split evenly.

    The calibration is the model × device kind's, made from varied prefill and decode
    steps (as a disaggregated prefill pool makes them): a chunked engine alone runs
    steps of one size, from which no fit can tell the shared part from the per-token
    one (docs/operations/chargeback-method.md)."""
    bills = {}
    for chunk in (0, 512):
        rng = random.Random(11)
        calib = ClockedSim()
        acc = new_attributor()
        warm_up(calib, rng)
        bill(calib, acc)
        assert acc.calibration.describe()[KEY]["prefill"]["status"] == "fit"
        eng = ClockedSim(chunk)
        eng.now = calib.now
        for j in range(24):
            eng.submit(f"bg{j}", 200 + j, 200, rng)
        # let the background decode a few steps, then the long prompt comes
        for _ in range(30 if chunk else 3):
            eng._slept = 0.0
            for ev in eng.step():
                if isinstance(ev, IterationRecord):
                    ev.start, ev.wall_s = eng.now, eng._slept
                    eng.now += eng._slept
                    eng.records.append(ev)
        eng.submit("P", 6000, 1, rng)
        eng.run()
        phases = {r.phase for r in eng.records if any(e[0] == "P" for e in r.entries)}
        assert phases == ({"mixed"} if chunk else {"prefill"}), phases
        bills[chunk] = bill(eng, acc)[("P", "prefill")]
    print("chunked vs unchunked prefill bill (s):", bills)
    assert bills[512] == pytest.approx(bills[0], rel=0.05), bills
    alone = TIMING.prefill_s([6000], [0])
    assert bills[0] == pytest.approx(alone, rel=0.05)       # unchunked it ran alone


def test_a_fit_with_a_negative_term_never_reaches_the_bill():
    """Step times where more context makes a decode step *cheaper* (nothing physical
    does that; a noisy or confounded fit can): the negative term is dropped, the
    remaining terms refitted, and `describe` says so."""
    cal = Calibration(min_iterations=10)
    rng = random.Random(3)
    for i in range(60):
        n = rng.randint(1, 32)
        ctx = [rng.randint(10, 4000) for _ in range(n)]
        wall = 0.02 + 1e-4 * n - 2e-7 * sum(ctx) + 2e-7 * 4000 * n
        cal.observe("m|H100-SXM", IterationRecord("w", "decode", T0, max(wall, 1e-3), ("g",),
                                                  False, [(f"r{j}", 1, c) for j, c in enumerate(ctx)]))
    d = cal.describe()["m|H100-SXM"]["decode"]
    assert d["status"] == "constrained" and "per-context" in d["note"], d
    assert d["s_per_context"] == 0.0 and d["c0_s"] >= 0 and d["s_per_seq"] > 0
    w = cal.weights("m|H100-SXM")
    assert w.d_ctx == 0.0 and w.d_seq > 0 and w.d_c0 >= 0


def test_calibration_belongs_to_the_served_model_and_added_devices_count_from_their_first_window():
    """A swap: the same worker's steps are fitted under the new model from the change on,
    the old model's terms stay under its name. A repartition that adds a device: it is
    in every window from the one it arrives in, none before."""
    dev = DeviceInfo("g0", "H100-SXM", "sim", True)
    a = Attributor([dev], "old-model", 10.0, Calibration(min_iterations=3), start=T0)
    rng = random.Random(5)

    def steps(t0: float, n: int) -> float:
        for i in range(n):
            ctx = [rng.randint(10, 3000) for _ in range(rng.randint(1, 8))]
            wall = TIMING.decode_s(ctx)
            a.add(IterationRecord("w0", "decode", t0, wall, ("g0",), True,
                                  [(f"r{t0}-{i}-{j}", 1, c) for j, c in enumerate(ctx)]))
            t0 += wall
        return t0

    steps(T0 + 1, 20)
    assert [w.device for w in a.close_until(T0 + 10, None)] == ["g0"]
    a.serve({"w0": "new-model"}, [dev, DeviceInfo("g1", "H100-SXM", "sim", True)])
    steps(T0 + 11, 10)
    windows = a.close_until(T0 + 20, None)
    assert sorted(w.device for w in windows) == ["g0", "g1"]
    (g1,) = [w for w in windows if w.device == "g1"]
    assert g1.measured_gpu_s == pytest.approx(10.0) and g1.idle_gpu_s == pytest.approx(10.0)
    shown = a.calibration.describe()
    assert set(shown) == {"old-model|H100-SXM", "new-model|H100-SXM"}
    assert shown["old-model|H100-SXM"]["decode"]["samples"] == 20
    assert shown["new-model|H100-SXM"]["decode"]["samples"] == 10
    assert shown["new-model|H100-SXM"]["model"] == "new-model"


def test_steps_before_a_swap_stay_with_the_old_model_when_their_window_closes_after_it():
    """A swap-model restarts workers under the same names, often before the window that
    holds the old model's last steps has closed: those steps are fitted under the model
    the worker served when they ran, not the one it serves when the window closes."""
    dev = DeviceInfo("g0", "H100-SXM", "sim", True)
    a = Attributor([dev], "old-model", 10.0, Calibration(min_iterations=3), start=T0)
    t = T0 + 1
    for i in range(12):
        wall = TIMING.decode_s([100 * (i + 1)])
        a.add(IterationRecord("w0", "decode", t, wall, ("g0",), True, [(f"a{i}", 1, 100 * (i + 1))]))
        t += wall
    a.serve({"w0": "new-model"}, [dev])          # the window [T0, T0+10) is still open
    for i in range(5):
        wall = TIMING.decode_s([50 * (i + 1)])
        a.add(IterationRecord("w0", "decode", t, wall, ("g0",), True, [(f"b{i}", 1, 50 * (i + 1))]))
        t += wall
    a.close_until(T0 + 10, None)
    shown = a.calibration.describe()
    assert shown["old-model|H100-SXM"]["decode"]["samples"] == 12
    assert shown["new-model|H100-SXM"]["decode"]["samples"] == 5


def test_on_the_cpu_torch_engine_long_contexts_pay_what_they_cost(tiny_model):
    """The real torch engine on the CPU (real step times, a machine shared with other
    work): tenants L (~1,200-token contexts) and S (~60, 20× shorter) decode in the same
    batches. L's decode cost per output token over S's must lie within the fit's error
    of what the device itself takes: the median step time of a batch of only long
    contexts over one of only short ones at the same batch size, measured right after."""
    import statistics

    import torch

    from appliance.engines.torch_engine import build_torch_engine
    from appliance.worker.spec import WorkerSpec
    from test_torch_engine import block_bytes

    torch.set_num_threads(1)
    spec = WorkerSpec(worker="c0", role="agg", engine="torch", devices=["cpu0"],
                      device_kind="cpu", model_dir=str(tiny_model), block_size=16,
                      max_batch_tokens=4096, max_seqs=64,
                      kv_cache_bytes=1200 * block_bytes(tiny_model, 16))
    eng = build_torch_engine(spec, tiny_model)
    records: list[IterationRecord] = []
    rng = random.Random(2)

    def submit(rid: str, n: int, out: int) -> None:
        prompt = [rng.randrange(10, 1000) for _ in range(n)]
        assert eng.add(Prefill(rid, prompt, SamplingParams(max_tokens=out, temperature=0.0,
                                                           ignore_eos=True), handoff=False)) == []

    def run() -> None:
        while eng.has_work():
            records.extend(ev for ev in eng.step() if isinstance(ev, IterationRecord))

    for w in range(16):                               # varied batches for the fit
        for j in range(rng.randint(0, 4)):
            submit(f"w{w}L{j}", rng.randint(900, 1400), rng.randint(6, 16))
        for j in range(rng.randint(1, 6)):
            submit(f"w{w}S{j}", rng.randint(30, 90), rng.randint(6, 16))
        run()
    acc = Attributor([DeviceInfo("cpu0", "cpu", "cpu", False)], "tiny-llama", 1.0,
                     Calibration(min_iterations=20), start=records[0].start - 1)
    for r in records:
        acc.add(r)
    acc.close_until(time.time() + 3600.0, None, final=True)
    fit = acc.calibration.describe()["tiny-llama|cpu"]["decode"]
    assert fit["status"] in ("fit", "constrained"), fit
    err = fit["rmse_s"] / fit["mean_step_s"]

    records.clear()
    for j in range(4):
        submit(f"L{j}", 1200 + 7 * j, 24)
        submit(f"S{j}", 60 + j, 24)
    run()
    mixed = [r for r in records if r.phase == "decode"]
    assert all({e[0][0] for e in r.entries} == {"L", "S"} for r in mixed)
    acc2 = Attributor([DeviceInfo("cpu0", "cpu", "cpu", False)], "tiny-llama", 3600.0,
                      acc.calibration, start=records[0].start - 1)
    for r in records:
        acc2.add(r)
    billed: dict[str, float] = {"L": 0.0, "S": 0.0}
    tokens = {"L": 0, "S": 0}
    for w in acc2.close_until(time.time() + 3600.0, None, final=True):
        for (rid, ph), (g, _) in w.shares.items():
            if ph == "decode":
                billed[rid[0]] += g
    for r in mixed:
        for rid, _, _ in r.entries:
            tokens[rid[0]] += 1
    ratio = (billed["L"] / tokens["L"]) / (billed["S"] / tokens["S"])

    # what the device takes: 8 long vs 8 short, same engine, right after; the median of
    # three such pairs, as one pair's ratio swung 1.86-2.8 on a shared 2-core box (CI
    # failed on a pair at 1.86 while the bill's side stood at 3.44)
    pairs = []
    for rep in range(3):
        device = {}
        for kind, n in (("L", 1200), ("S", 60)):
            records.clear()
            for j in range(8):
                submit(f"ref{rep}{kind}{j}", n + j, 24)
            run()
            device[kind] = statistics.median(r.wall_s for r in records if r.phase == "decode")
        pairs.append(device["L"] / device["S"])
    physical = statistics.median(pairs)
    # the fit's error: its rms residual over the mean step. On a small machine shared
    # with other work it is large (35-70% measured on a loaded 2-core box), so this
    # bound is loose there; both sides of the comparison come from this same run.
    if err >= 1.0:     # seen at load averages ~16: residuals as large as the steps
        pytest.skip(f"the fit's error is {err:.2f} of a step: this machine is too loaded "
                    "for the comparison to mean anything")
    tol = 3 * err + 0.05
    print(f"CPU: billed L/S per token {ratio:.3f}, device L/S {physical:.3f} "
          f"(pairs {', '.join(f'{p:.3f}' for p in pairs)}), fit error {err:.3f}")
    # never cheaper per token for the longer contexts (no negative term reaches the
    # bill), and no dearer than the device's own ratio beyond the fit's error
    assert 1.0 <= ratio <= physical * (1 + tol), (ratio, physical, err, fit)
