"""The TensorRT-LLM engine driven through the engine contract, against a fake
`tensorrt_llm` (tests/fake_tensorrt_llm.py) injected into sys.modules: context-only
prefill -> picklable handle -> generation-only decode, aggregated requests, abort, the
constructor arguments per role, the one-line error without the library, and a drift
check of every API name the engine uses (against the fake always, and against the real
package wherever it is installed)."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import pickle
import sys
import time
from pathlib import Path

import pytest

from appliance.engines import trtllm
from appliance.engines.messages import (
    Decode, IterationRecord, KvImported, Prefill, PrefillDone, RequestFailed, SamplingParams,
    Tokens,
)
from appliance.worker.spec import WorkerSpec

from helpers import fake_tensorrt_llm as fake

PROMPT = [5, 17, 301, 42, 7, 9]
SINGLE = "TLLM_WORKER_USE_SINGLE_PROCESS"


@pytest.fixture
def fake_modules(monkeypatch):
    mods = fake.modules()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv(SINGLE, "unset-by-test")   # recorded, so teardown restores it
    monkeypatch.delenv(SINGLE)
    return mods


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16",
                                               "eos_token_id": 2}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return d


@pytest.fixture
def build(fake_modules, model_dir):
    built: list[trtllm.TrtllmEngine] = []

    def make(role: str, devices: tuple[str, ...] = ("gpu0",), **kw) -> trtllm.TrtllmEngine:
        eng = trtllm.build_trtllm_engine(spec(role, model_dir, devices, **kw), model_dir)
        built.append(eng)
        return eng

    yield make
    for eng in built:
        eng.close()


def spec(role: str, model_dir: Path, devices=("gpu0",), **kw) -> WorkerSpec:
    return WorkerSpec(worker=f"{role}0", role=role, engine="trtllm", devices=list(devices),
                      device_kind="gpu", model_dir=str(model_dir), **kw)


def drive(eng, done, timeout: float = 5.0) -> list:
    """Step like the worker loop until done(events)."""
    events: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events += eng.step()
        if done(events):
            return events
    raise AssertionError(f"not done after {timeout}s: {events}")


def idle(eng):
    return lambda events: not eng.has_work()


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def streamed(events, rid):
    toks, reasons = [], []
    for e in of(events, Tokens):
        if e.request_id == rid:
            toks += e.tokens
            reasons.append(e.finish_reason)
    return toks, reasons


# ---- disaggregated: context only -> handle -> generation only --------------------------

def test_prefill_hands_off_a_picklable_handle_and_decode_continues(build):
    pre, dec = build("prefill"), build("decode")
    llm_pre, llm_dec = fake.LLM.instances
    params = SamplingParams(max_tokens=8, seed=3, temperature=0.7)
    want = fake.expected_tokens(PROMPT, 8, seed=3)

    assert pre.add(Prefill("r1", PROMPT, params, handoff=True)) == []
    events = drive(pre, idle(pre))
    (done,) = of(events, PrefillDone)
    prompt_sent, sp, streaming, disagg = llm_pre.submitted[-1]
    assert prompt_sent == PROMPT and not streaming
    assert disagg.request_type == "context_only"
    assert trtllm.MIN_GLOBAL_DISAGG_ID <= disagg.disagg_request_id < 1 << 63
    assert sp.max_tokens == 1 and sp.seed == 3 and sp.end_id == 2 and sp.detokenize is False
    assert done.first_token == want[0] and done.finish_reason is None
    handle = done.handle
    assert handle.block_ids == [] and handle.num_tokens == len(PROMPT)
    assert handle.layout == "trtllm:tiny-llama:kv=bfloat16:tp=1" == pre.hello_info()["layout"]
    assert handle.payload["request_type"] == "context_only"
    assert handle.payload["first_gen_tokens"] == [want[0]]

    # The daemon carries the handle across processes: plain builtins only, no tensorrt_llm.
    wire = pickle.dumps(done)
    assert b"tensorrt_llm" not in wire
    handle = pickle.loads(wire).handle
    assert handle == done.handle

    assert dec.add(Decode("r1", PROMPT, done.first_token, params, handle)) == []
    events = drive(dec, idle(dec))
    _, sp, streaming, gen = llm_dec.submitted[-1]
    assert isinstance(gen, fake.DisaggregatedParams)
    assert gen.request_type == "generation_only" and streaming and sp.max_tokens == 8
    assert (gen.ctx_request_id, gen.opaque_state) == (done.handle.payload["ctx_request_id"],
                                                      done.handle.payload["opaque_state"])
    # The transceiver's session key travels with the handle to the generation side.
    assert gen.disagg_request_id == done.handle.payload["disagg_request_id"] \
        == disagg.disagg_request_id
    kinds = [type(e) for e in events if isinstance(e, (KvImported, Tokens))]
    assert kinds[0] is KvImported and of(events, KvImported)[0].source_worker == "prefill0"
    toks, reasons = streamed(events, "r1")
    assert toks == want[1:] and len(toks) == params.max_tokens - 1
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert fake.PENDING_CONTEXTS == {}      # the generation side pulled (and freed) the KV
    pre.release("r1")                       # nothing left to free on the context side
    time.sleep(0.02)                        # late iteration stats are all that may come
    assert all(isinstance(e, IterationRecord) for e in drive(pre, idle(pre)))
    assert not of(events, RequestFailed)


def test_context_requests_get_distinct_disagg_request_ids(build):
    pre = build("prefill")
    for rid in ("a", "b", "c"):
        pre.add(Prefill(rid, PROMPT, SamplingParams(max_tokens=4), handoff=True))
    done = of(drive(pre, idle(pre)), PrefillDone)
    ids = [d.disagg_request_id for _, _, _, d in fake.LLM.instances[0].submitted]
    assert len(set(ids)) == 3 and all(i >= trtllm.MIN_GLOBAL_DISAGG_ID for i in ids)
    assert sorted(d.handle.payload["disagg_request_id"] for d in done) == sorted(ids)


def test_fake_refuses_a_context_request_without_disagg_request_id(fake_modules):
    import asyncio

    async def submit():
        llm = fake.LLM(model="m", cache_transceiver_config=fake.CacheTransceiverConfig(
            backend="DEFAULT"))
        llm.generate_async(PROMPT, fake.SamplingParams(max_tokens=4),
                           disaggregated_params=fake.DisaggregatedParams(
                               request_type="context_only"))

    with pytest.raises(AssertionError, match="disagg_request_id"):
        asyncio.run(submit())


def test_prefill_of_one_token_hands_nothing_off(build):
    pre = build("prefill")
    pre.add(Prefill("r1", PROMPT, SamplingParams(max_tokens=1), handoff=True))
    (done,) = of(drive(pre, idle(pre)), PrefillDone)
    assert done.handle is None and done.finish_reason == "length"
    assert fake.LLM.instances[0].submitted[-1][3] is None     # a normal request
    assert fake.PENDING_CONTEXTS == {}


def test_decode_refuses_a_foreign_layout(build):
    pre, dec = build("prefill"), build("decode", devices=("gpu1", "gpu2"))
    pre.add(Prefill("r1", PROMPT, SamplingParams(max_tokens=4), handoff=True))
    (done,) = of(drive(pre, idle(pre)), PrefillDone)
    (failed,) = dec.add(Decode("r1", PROMPT, done.first_token, SamplingParams(max_tokens=4),
                               done.handle))
    assert failed.code == "kv_layout_mismatch" and "tp=1" in failed.message


# ---- aggregated --------------------------------------------------------------------

def test_agg_streams_max_tokens_and_reports_iterations(build):
    agg = build("agg")
    params = SamplingParams(max_tokens=6, seed=11)
    agg.add(Prefill("a", PROMPT, params, handoff=False))
    events = drive(agg, idle(agg))
    toks, reasons = streamed(events, "a")
    assert toks == fake.expected_tokens(PROMPT, 6, seed=11)
    assert reasons[-1] == "length"
    assert fake.LLM.instances[0].submitted[-1][3] is None
    # Records come from the fake's iteration stats; the entries account for every token.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and sum(
            n for r in of(events, IterationRecord) for _, n, _ in r.entries) < len(PROMPT) + 5:
        events += agg.step()
    records = of(events, IterationRecord)
    assert records and records[0].phase == "prefill" and records[-1].phase == "decode"
    assert all(r.wall_s > 0 and r.worker == "agg0" and r.devices == ("gpu0",) for r in records)
    assert all(r.approximate for r in records)     # reconstructed, and they say so
    assert sum(n for r in records for _, n, _ in r.entries) == len(PROMPT) + 5
    stats = agg.stats()
    assert stats.kv_blocks_total > 0 and stats.iterations == len(records)
    assert stats.waiting == stats.running == 0


def test_stop_token_and_refused_prompt(build):
    agg = build("agg", max_batch_tokens=64)
    want = fake.expected_tokens(PROMPT, 10, seed=5)
    agg.add(Prefill("s", PROMPT, SamplingParams(max_tokens=10, seed=5,
                                                stop_token_ids=(want[3],)), False))
    agg.add(Prefill("long", list(range(1, 100)), SamplingParams(max_tokens=4), False))
    events = drive(agg, idle(agg))
    toks, reasons = streamed(events, "s")
    assert toks == want[:4] and reasons[-1] == "stop"    # the stop token is kept, like ours
    (failed,) = of(events, RequestFailed)
    assert failed.request_id == "long" and failed.code == "invalid_request"


def test_sampling_controls_reach_tensorrt_llm_or_are_refused(build):
    agg = build("agg")
    agg.add(Prefill("k", PROMPT, SamplingParams(max_tokens=2, top_k=5, frequency_penalty=0.5,
                                                presence_penalty=-0.25), False))
    agg.add(Prefill("plain", PROMPT, SamplingParams(max_tokens=2), False))
    (lp,) = agg.add(Prefill("lp", PROMPT, SamplingParams(max_tokens=2, logprobs=1), False))
    (bias,) = agg.add(Prefill("b", PROMPT, SamplingParams(max_tokens=2,
                                                          logit_bias=((3, 5.0),)), False))
    assert lp.code == bias.code == "invalid_request" and "logprobs" in lp.message
    drive(agg, idle(agg))
    (k, plain) = [sp for _, sp, _, _ in fake.LLM.instances[0].submitted]
    assert (k.top_k, k.frequency_penalty, k.presence_penalty) == (5, 0.5, -0.25)
    assert (plain.top_k, plain.frequency_penalty, plain.presence_penalty) == (None, None, None)


# ---- abort -------------------------------------------------------------------------

def test_unseeded_requests_get_a_seed_of_their_own(build):
    agg = build("agg")
    agg.add(Prefill("x", PROMPT, SamplingParams(max_tokens=2), False))
    agg.add(Prefill("y", PROMPT, SamplingParams(max_tokens=2), False))
    drive(agg, idle(agg))
    seeds = [sp.seed for _, sp, _, _ in fake.LLM.instances[0].submitted]
    assert None not in seeds and seeds[0] != seeds[1]


def test_abort_calls_the_requests_abort(build):
    agg = build("agg")
    llm = fake.LLM.instances[0]
    agg.add(Prefill("a", PROMPT, SamplingParams(max_tokens=10_000), handoff=False))
    drive(agg, lambda ev: bool(of(ev, Tokens)))
    agg.abort("a")
    agg.add(Prefill("b", PROMPT, SamplingParams(max_tokens=10_000), handoff=False))
    agg.abort("b")                                  # before its coroutine even ran
    events = drive(agg, lambda ev: len(llm.aborted) == 2 and not agg.has_work())
    assert sorted(llm.aborted) == [1, 2]
    assert not of(events, Tokens) and not of(events, RequestFailed)   # late output dropped
    assert agg.stats().running == 0


# ---- construction ------------------------------------------------------------------

def test_constructor_arguments_per_role(build):
    build("prefill", devices=("gpu0", "gpu1"), handoff_timeout_s=12.5)
    import os
    assert SINGLE not in os.environ                 # tp=2: TensorRT-LLM's MPI workers
    build("decode", devices=("gpu2",))
    assert os.environ[SINGLE] == "1"                # tp=1: no MPI worker process
    build("agg", devices=("gpu3",))
    pre, dec, agg = fake.LLM.instances
    assert (pre.tensor_parallel_size, dec.tensor_parallel_size, agg.tensor_parallel_size) == (2, 1, 1)
    assert pre.cache_transceiver_config.backend == dec.cache_transceiver_config.backend == "DEFAULT"
    assert pre.cache_transceiver_config.kv_transfer_timeout_ms == 12_500
    assert pre.kwargs["disable_overlap_scheduler"] is True
    assert "disable_overlap_scheduler" not in dec.kwargs
    assert agg.cache_transceiver_config is None
    for llm in (pre, dec, agg):
        assert llm.kwargs["enable_iter_perf_stats"] is True
        assert llm.kv_cache_config.free_gpu_memory_fraction == 0.9


@pytest.mark.parametrize("accepted,want", [(fake.TRANSCEIVER_BACKENDS, "DEFAULT"),
                                           (fake.OLD_TRANSCEIVER_BACKENDS, "default")])
def test_transceiver_backend_is_spelled_as_the_release_wants(build, monkeypatch, accepted,
                                                             want):
    monkeypatch.setattr(fake, "TRANSCEIVER_BACKENDS", accepted)
    with pytest.raises(ValueError):     # the fake refuses the other spelling, as pydantic does
        fake.CacheTransceiverConfig(backend=want.swapcase())
    build("prefill")
    assert fake.LLM.instances[0].cache_transceiver_config.backend == want


def test_unknown_transceiver_backend_is_one_clear_line(build, monkeypatch):
    monkeypatch.setenv(trtllm.KV_BACKEND_ENV, "carrier-pigeon")
    with pytest.raises(trtllm.TrtllmUnavailable) as info:
        build("decode")
    msg = str(info.value)
    assert "\n" not in msg and "carrier-pigeon" in msg and trtllm.KV_BACKEND_ENV in msg


def test_missing_library_is_one_clear_line(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)     # `import tensorrt_llm` fails
    from appliance.worker.engine_factory import build_engine
    with pytest.raises(trtllm.TrtllmUnavailable) as info:
        build_engine(spec("decode", model_dir))
    assert str(info.value) == trtllm.MISSING_MESSAGE
    assert "\n" not in str(info.value) and "--engine torch" in str(info.value)


def test_cpu_workers_are_refused(fake_modules, model_dir):
    s = dataclasses.replace(spec("agg", model_dir), device_kind="cpu")
    with pytest.raises(trtllm.TrtllmUnavailable, match="needs NVIDIA GPUs"):
        trtllm.build_trtllm_engine(s, model_dir)


# ---- API drift ---------------------------------------------------------------------

def _declared(cls) -> set[str]:
    if hasattr(cls, "model_fields"):                # pydantic configs (and the fake's)
        return set(cls.model_fields)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(dir(cls))


def api_drift(mods: dict) -> list[str]:
    """Names in trtllm.USED_API that `mods` (module name -> module) lacks."""
    api = trtllm.USED_API
    missing, classes = [], {}
    for mod_name, names in api["modules"].items():
        for n in names:
            if hasattr(mods[mod_name], n):
                classes.setdefault(n, getattr(mods[mod_name], n))
            else:
                missing.append(f"{mod_name}.{n}")
    if missing:
        return missing
    for cls_name, names in api["methods"].items():
        missing += [f"{cls_name}.{n}" for n in names if not hasattr(classes[cls_name], n)]
    torch_args = mods["tensorrt_llm.llmapi.llm_args"].TorchLlmArgs
    for target, names in api["params"].items():
        cls_name, _, method = target.partition(".")
        fn = getattr(classes[cls_name], method or "__init__")
        accepted = set(inspect.signature(fn).parameters)
        if not method:
            accepted |= set(torch_args.model_fields)
        missing += [f"{target}({n}=...)" for n in names if n not in accepted]
    for cls_name, names in api["fields"].items():
        declared = _declared(classes[cls_name])
        missing += [f"{cls_name}.{n}" for n in names if n not in declared]
    return missing


def test_engine_uses_only_names_the_fake_has(fake_modules):
    assert api_drift(fake_modules) == []


def test_drift_check_notices_a_renamed_field(fake_modules, monkeypatch):
    monkeypatch.setattr(fake.CacheTransceiverConfig, "model_fields", {"comm_backend": None})
    monkeypatch.delattr(fake.LLM, "get_stats_async")
    assert api_drift(fake_modules) == ["LLM.get_stats_async", "CacheTransceiverConfig.backend"]


# The same check runs against the real package on machines where it is installed (GPU
# boxes with NVIDIA's index): if TensorRT-LLM renames something we use, this fails there.
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                    reason="tensorrt_llm is not installed")
def test_engine_uses_only_names_the_real_package_has():
    names = ["tensorrt_llm", "tensorrt_llm.llmapi", "tensorrt_llm.llmapi.llm_args"]
    try:
        mods = {n: importlib.import_module(n) for n in names}
    except (ImportError, OSError, RuntimeError) as exc:     # installed but no libcuda
        pytest.skip(f"tensorrt_llm does not import here: {exc}")
    assert api_drift(mods) == []


# ---- release drift (issue 24 §3) -----------------------------------------------------

def _greedy_old(sp) -> bool:
    """`SamplingParams._greedy_decoding` of older releases (tensorrt_llm/sampling_params.py):
    temperature is not looked at."""
    return (not sp.use_beam_search and (sp.top_k is None or sp.top_k == 1)
            and (sp.top_p is None or sp.top_p == 0.0))


def _greedy_new(sp) -> bool:
    """`SamplingParams.params_imply_greedy_decoding` of current releases."""
    return (not sp.use_beam_search and (
        (sp.temperature is None and sp.top_p is None and sp.top_k is None)
        or sp.top_k == 1 or sp.top_p == 0.0 or sp.temperature == 0))


def test_greedy_requests_are_top_k_1_on_every_release(build):
    agg = build("agg")
    agg.add(Prefill("g", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), False))
    agg.add(Prefill("p0", PROMPT, SamplingParams(max_tokens=2, top_p=0.0, top_k=7), False))
    agg.add(Prefill("s", PROMPT, SamplingParams(max_tokens=2, temperature=0.7), False))
    drive(agg, idle(agg))
    g, p0, s = [sp for _, sp, _, _ in fake.LLM.instances[0].submitted]
    for sp in (g, p0):
        assert sp.top_k == 1 and sp.temperature is None and sp.top_p is None
        assert _greedy_old(sp) and _greedy_new(sp)
    assert not _greedy_old(s) and not _greedy_new(s) and s.temperature == 0.7
    # What temperature=0 alone (with OpenAI's top_p=1) was on an older release: sampling.
    assert not _greedy_old(fake.SamplingParams(temperature=0.0, top_p=1.0))


def _stats(ts: str, latency_ms: float, **extra) -> dict:
    return {"timestamp": ts, "iter": 1, "iterLatencyMS": latency_ms,
            "inflightBatchingStats": {"numScheduledRequests": 1, "numContextRequests": 0,
                                      "numGenRequests": 1}, **extra}


def test_iteration_time_without_scheduler_mode_is_the_timestamp_gap(build):
    """Older releases have no schedulerMode/hostStepTimeMS and may run the overlap
    scheduler, whose iterLatencyMS spans two loops: the gap between consecutive stats'
    timestamps is the iteration (capped by iterLatencyMS when the gap spans idle time)."""
    agg = build("agg")
    seq = [_stats("01-02-2026 10:00:00.000000", 41.0),
           _stats("01-02-2026 10:00:00.020000", 40.0),
           _stats("01-02-2026 10:00:05.000000", 39.0),    # 5 s idle before this one
           _stats("01-02-2026 10:00:05.021000", 40.0)]
    records = [r for r in (agg._on_stats(dict(st)) for st in seq) if r is not None]
    assert [round(r.wall_s, 4) for r in records] == [0.020, 0.040, 0.021]
    # Current releases say which scheduler ran: hostStepTimeMS under overlap.
    agg2 = build("decode")
    seq = [_stats("01-02-2026 10:00:00.000000", 41.0, schedulerMode="overlap",
                  hostStepTimeMS=19.5),
           _stats("01-02-2026 10:00:00.020000", 40.0, schedulerMode="overlap",
                  hostStepTimeMS=20.0)]
    (rec,) = [r for r in (agg2._on_stats(dict(st)) for st in seq) if r is not None]
    assert rec.wall_s == pytest.approx(0.0195)
    # Whole-second timestamps (no gap to measure): iterLatencyMS as it comes.
    assert trtllm.iteration_seconds(_stats("01-02-2026 10:00:00", 33.0),
                                    None) == pytest.approx(0.033)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_disaggregated_roles_refused_without_kv_transfer_timeout(build, monkeypatch, role):
    fields = dict(fake.CacheTransceiverConfig.model_fields)
    del fields["kv_transfer_timeout_ms"]
    monkeypatch.setattr(fake.CacheTransceiverConfig, "model_fields", fields)
    with pytest.raises(trtllm.TrtllmUnavailable) as err:
        build(role)
    msg = str(err.value)
    assert "\n" not in msg and "kv_transfer_timeout_ms" in msg and "mode = agg" in msg
    assert not fake.LLM.instances                    # refused before any LLM was built
    build("agg")                                     # agg needs no transceiver
    assert fake.LLM.instances[0].cache_transceiver_config is None


# ---- structured outputs and vLLM's sampling extensions -----------------------------

def test_guided_decoding_and_extensions_reach_tensorrt_llm(build):
    pytest.importorskip("xgrammar")
    from appliance.engines.grammar import ebnf
    from appliance.engines.messages import GuidedDecoding
    agg = build("agg")
    assert fake.LLM.instances[0].kwargs["guided_decoding_backend"] == "xgrammar"
    spec = GuidedDecoding("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    agg.add(Prefill("g", PROMPT, SamplingParams(max_tokens=2, guided=spec, min_tokens=1,
                                                repetition_penalty=1.3, min_p=0.05), False))
    agg.add(Prefill("plain", PROMPT, SamplingParams(max_tokens=2), False))
    (bad,) = agg.add(Prefill("bad", PROMPT, SamplingParams(
        max_tokens=2, guided=GuidedDecoding("regex", "((")), False))
    assert bad.code == "invalid_request" and "regex" in bad.message.lower()
    drive(agg, idle(agg))
    (g, plain) = [sp for _, sp, _, _ in fake.LLM.instances[0].submitted]
    assert isinstance(g.guided_decoding, fake.GuidedDecodingParams)
    assert g.guided_decoding.grammar == ebnf(spec) and "root ::=" in g.guided_decoding.grammar
    assert (g.min_tokens, g.repetition_penalty, g.min_p) == (1, 1.3, 0.05)
    assert (plain.guided_decoding, plain.min_tokens, plain.repetition_penalty,
            plain.min_p) == (None, None, None, None)


# ---- [cluster]: the transceiver's endpoints across boxes (issue 29) -------------------

PEERS = ["https://decode-1:8443", "http://10.0.2.7:8000"]
ROUTES = {"decode-1": "10.0.1.5", "10.0.2.7": "10.0.2.5"}
NICS = {"127.0.0.1": "lo", "10.0.1.5": "ens4np0", "10.0.2.5": "ens5np0", "172.17.0.1": "docker0"}


def _route(host: str) -> str:
    """The kernel's route lookup, faked: the network is the hardware boundary here
    (tests/integration/test_trtllm_endpoints.py runs the real one on loopback)."""
    if host not in ROUTES:
        raise OSError(f"[Errno -2] Name or service not known: {host}")
    return ROUTES[host]


def test_interface_towards_the_peers_is_the_one_their_route_leaves_by():
    iface, why = trtllm.interface_towards(PEERS[:1], _route, lambda: NICS)
    assert iface == "ens4np0" and why == "routes to decode-1"
    iface, why = trtllm.interface_towards(["http://nowhere:1"] + PEERS, _route, lambda: NICS)
    assert iface == "ens4np0"                       # the first peer that resolves
    assert "ens5np0" in why and "one interface is used" in why
    iface, why = trtllm.interface_towards(["http://nowhere:1"], _route, lambda: NICS)
    assert iface is None and "nowhere" in why and "Name or service not known" in why


def test_a_cluster_box_wires_nixl_and_the_interface_towards_its_peers(build, monkeypatch):
    import os
    monkeypatch.setattr(trtllm, "_local_ip_towards", _route)
    monkeypatch.setattr(trtllm, "_interface_addresses", lambda: NICS)
    monkeypatch.setenv(trtllm.TRTLLM_INTERFACE_ENV, "")     # recorded: teardown restores it
    monkeypatch.delenv(trtllm.TRTLLM_INTERFACE_ENV)
    build("prefill", cluster_peers=PEERS[:1])
    assert os.environ[trtllm.TRTLLM_INTERFACE_ENV] == "ens4np0"
    build("decode")                                 # one box: TensorRT-LLM's default
    build("agg", cluster_peers=PEERS[:1])           # agg: no transceiver at all
    pre, dec, agg = fake.LLM.instances
    assert pre.cache_transceiver_config.backend == "NIXL"
    assert dec.cache_transceiver_config.backend == "DEFAULT"
    assert agg.cache_transceiver_config is None
    # The operator's own choices win: the interface variable and the backend variable.
    monkeypatch.setenv(trtllm.TRTLLM_INTERFACE_ENV, "ib0")
    monkeypatch.setenv(trtllm.KV_BACKEND_ENV, "UCX")
    build("decode", cluster_peers=PEERS[:1])
    assert os.environ[trtllm.TRTLLM_INTERFACE_ENV] == "ib0"
    assert fake.LLM.instances[-1].cache_transceiver_config.backend == "UCX"


def test_worker_specs_carry_the_cluster_peers_only_off_a_single_box():
    from appliance.config import ClusterConfig, Config
    from appliance.daemon.setup import worker_specs
    from appliance.partitions import discover, plan_partition
    inv = discover("sim:2xH100")
    plan = plan_partition(inv)
    key = "k" * 16
    for role, want in (("both", []), ("decode", PEERS[:1])):
        cfg = Config(cluster=ClusterConfig(role=role, peers=PEERS[:1], key=key))
        specs = worker_specs(cfg, inv, plan, "trtllm", Path("/m"))
        assert specs and all(s.cluster_peers == want for s in specs)
        assert WorkerSpec.from_json(specs[0].to_json()) == specs[0]    # crosses as JSON


# ---- issue 27: the request's priority class reaches TensorRT-LLM's scheduler ----------

def test_priority_classes_map_monotonically_onto_trtllm_priorities():
    got = [trtllm.trtllm_priority(p) for p in (-3, -1, 0, 1, 3, 10**6)]
    assert got == sorted(got, reverse=True)          # lower class = higher priority
    assert trtllm.trtllm_priority(0) == 0.5           # the default stays TensorRT-LLM's
    assert all(0.0 <= g <= 1.0 for g in got) and len(set(got)) == len(got)


def test_priority_reaches_generate_async(build):
    eng = build("agg")
    llm = fake.LLM.instances[0]
    params = SamplingParams(max_tokens=2, seed=1)
    assert eng.add(Prefill("hi", PROMPT, params, handoff=False, priority=0)) == []
    assert eng.add(Prefill("lo", PROMPT, params, handoff=False, tenant="batch", priority=5)) == []
    drive(eng, idle(eng))
    assert sorted(llm.priorities, reverse=True) == [0.5, trtllm.trtllm_priority(5)]
    pre, dec = build("prefill"), build("decode")
    llm_pre, llm_dec = fake.LLM.instances[1:]
    assert pre.add(Prefill("r", PROMPT, params, handoff=True, priority=2)) == []
    (done,) = of(drive(pre, idle(pre)), PrefillDone)
    assert dec.add(Decode("r", PROMPT, done.first_token, params, done.handle, priority=2)) == []
    drive(dec, idle(dec))
    assert llm_pre.priorities == llm_dec.priorities == [trtllm.trtllm_priority(2)]


def test_a_release_without_priority_is_not_sent_one(build, monkeypatch):
    plain = fake.LLM.generate_async

    def old_generate_async(self, inputs, sampling_params=None, lora_request=None,
                           prompt_adapter_request=None, streaming=False,
                           kv_cache_retention_config=None, disaggregated_params=None):
        return plain(self, inputs, sampling_params, streaming=streaming,
                     disaggregated_params=disaggregated_params)

    monkeypatch.setattr(fake.LLM, "generate_async", old_generate_async)
    eng = build("agg")
    assert eng.takes_priority is False
    assert eng.add(Prefill("r", PROMPT, SamplingParams(max_tokens=2), handoff=False,
                           priority=3)) == []
    toks, reasons = streamed(drive(eng, idle(eng)), "r")
    assert len(toks) == 2 and reasons[-1] == "length"
