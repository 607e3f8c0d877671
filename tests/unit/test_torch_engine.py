"""The torch engine driven through the engine contract, in-process, on the generated tiny
checkpoint: agg and disagg greedy output == transformers `generate`, prefix-cache hits,
seeded sampling independent of batch composition, layout refusal, preemption."""
from __future__ import annotations

import json
import random

import pytest
import torch

from appliance.engines.messages import (
    Decode, IterationRecord, KvHandle, KvImported, Prefill, PrefillDone, RequestFailed,
    SamplingParams, Tokens,
)
from appliance.engines.sequence import Role, Sequence
from appliance.engines.torch_engine import TorchEngine, build_torch_engine
from appliance.worker.spec import WorkerSpec
from helpers.memory_maps import resident_bytes, vm_flags

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

BS = 16
N_NEW = 24
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0)


def block_bytes(model_dir, block_size: int = BS) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * hd * 4


def make_engine(model_dir, worker: str, *, num_blocks: int = 256, block_size: int = BS,
                role: str = "agg", reserve_ratio: float = 1.0, chunk: int = 0) -> TorchEngine:
    spec = WorkerSpec(worker=worker, role=role, engine="torch", devices=[f"cpu-{worker}"],
                      device_kind="cpu", model_dir=str(model_dir), block_size=block_size,
                      max_batch_tokens=2048, max_seqs=64, reserve_ratio=reserve_ratio,
                      kv_cache_bytes=num_blocks * block_bytes(model_dir, block_size),
                      prefill_chunk_tokens=chunk)
    eng = build_torch_engine(spec, model_dir)
    assert eng.blocks.num_blocks == num_blocks
    return eng


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = ("import os\nimport sys\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):"
            "\n        path = os.path.join(argv[1], name)\n        if os.path.isfile(path):\n"
            "            print(name, os.path.getsize(path))\n    return 0\n\n"
            "class Config:\n    def __init__(self, path):\n        self.path = path\n"
            "        self.values = {}\n")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > 70, len(ids)
    bos = 0
    shared = [bos] + ids[:34]                 # two full blocks + 3 tokens of a shared prefix
    return {
        "short": [bos] + ids[40:45],          # 6 tokens
        "long": [bos] + ids[10:50],           # 41 tokens: three blocks, one partial
        "block": [bos] + ids[20:36],          # 17 tokens: a full block plus one
        "prefA": shared + ids[50:55],         # 40 tokens
        "prefB": shared + ids[60:68],         # 43 tokens, same first 2 blocks as prefA
    }


@pytest.fixture(scope="module")
def reference(tiny_model, prompts) -> dict[str, list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding)."""
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, p in prompts.items():
            gen = model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False)
            out[name] = gen[0, len(p):].tolist()
    return out


def collect(events, out: dict, cached: dict, records: list | None = None,
            lps: dict | None = None) -> None:
    for ev in events:
        if isinstance(ev, Tokens):
            out.setdefault(ev.request_id, []).extend(ev.tokens)
            cached.setdefault(ev.request_id, ev.cached_tokens)
            if lps is not None and ev.logprobs is not None:
                lps.setdefault(ev.request_id, []).extend(ev.logprobs)
        elif isinstance(ev, RequestFailed):
            raise AssertionError(f"request failed: {ev}")
        elif isinstance(ev, IterationRecord) and records is not None:
            records.append(ev)


def run_agg(eng: TorchEngine, first: dict[str, list[int]], later: dict[str, list[int]],
            params: dict[str, SamplingParams] | None = None, lps: dict | None = None):
    """Add `first`, run one step (their prefill), add `later`, run to idle."""
    params = params or {}
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    records: list[IterationRecord] = []
    for name, p in first.items():
        assert eng.add(Prefill(name, p, params.get(name, GREEDY), handoff=False)) == []
    collect(eng.step(), out, cached, records, lps)
    for name, p in later.items():
        assert eng.add(Prefill(name, p, params.get(name, GREEDY), handoff=False)) == []
    for _ in range(10_000):
        if not eng.has_work():
            break
        collect(eng.step(), out, cached, records, lps)
    assert not eng.has_work()
    return out, cached, records


def run_disagg(pre: TorchEngine, dec: TorchEngine, first: dict, later: dict,
               params: dict | None = None, lps: dict | None = None):
    """What the router does: Prefill(handoff) on `pre`, Decode(handle) on `dec`,
    Release to `pre` once `dec` reports KvImported."""
    params = params or {}
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    dec_phases: list[str] = []
    prompts = {**first, **later}

    def prefill_events(events):
        for ev in events:
            if isinstance(ev, PrefillDone):
                out[ev.request_id] = [ev.first_token]
                cached[ev.request_id] = ev.cached_tokens
                if lps is not None and ev.logprobs is not None:
                    lps[ev.request_id] = list(ev.logprobs)
                if ev.handle is not None:
                    rid = ev.request_id
                    r = dec.add(Decode(rid, prompts[rid], ev.first_token,
                                       params.get(rid, GREEDY), ev.handle))
                    assert r == [], r
            elif isinstance(ev, RequestFailed):
                raise AssertionError(f"prefill failed: {ev}")

    for name, p in first.items():
        assert pre.add(Prefill(name, p, params.get(name, GREEDY), handoff=True)) == []
    prefill_events(pre.step())
    for name, p in later.items():
        assert pre.add(Prefill(name, p, params.get(name, GREEDY), handoff=True)) == []
    for _ in range(10_000):
        if not (pre.has_work() or dec.has_work()):
            break
        if pre.has_work():
            prefill_events(pre.step())
        if dec.has_work():
            for ev in dec.step():
                if isinstance(ev, KvImported):
                    assert ev.source_worker == pre.worker
                    pre.release(ev.request_id)
                elif isinstance(ev, IterationRecord):
                    dec_phases.append(ev.phase)
                else:
                    collect([ev], out, {}, None, lps)
    return out, cached, dec_phases


def assert_all_free(*engines: TorchEngine) -> None:
    for eng in engines:
        st = eng.stats()
        assert st.kv_blocks_free == st.kv_blocks_total, (eng.worker, st)
        assert st.kv_blocks_handed_off == 0 and eng.blocks.reserved == 0, st


FIRST = ("short", "long", "prefA")
LATER = ("block", "prefB")


def split(prompts):
    return ({k: prompts[k] for k in FIRST}, {k: prompts[k] for k in LATER})


# --------------------------------------------------------------------------- (a) agg


def test_agg_greedy_matches_transformers(tiny_model, prompts, reference):
    eng = make_engine(tiny_model, "agg0")
    first, later = split(prompts)
    out, cached, records = run_agg(eng, first, later)
    for name in prompts:
        assert out[name] == reference[name], name
    # prefB was prefilled after prefA's blocks were committed: its shared two blocks hit.
    assert cached["prefB"] == 2 * BS
    assert cached["prefA"] == 0 and cached["long"] == 0
    assert eng.stats().prefix_hit_tokens == 2 * BS
    # Requests really were batched: decode steps with all five sequences.
    assert max(len(r.entries) for r in records if r.phase == "decode") == len(prompts)
    assert_all_free(eng)


# --------------------------------------------------------------------------- (b) disagg


def test_disagg_handoff_matches_agg(tiny_model, prompts, reference):
    pre = make_engine(tiny_model, "prefill0", role="prefill")
    dec = make_engine(tiny_model, "decode0", role="decode")
    assert isinstance(pre.peer_handle(), bytes) and len(pre.peer_handle()) < 4096
    dec.attach_peer(pre.worker, pre.peer_handle())
    first, later = split(prompts)
    out, cached, dec_phases = run_disagg(pre, dec, first, later)
    for name in prompts:
        assert out[name] == reference[name], name
    assert cached["prefB"] == 2 * BS
    # The decode worker never ran a prompt: its KV came from the prefill worker's pool.
    assert "prefill" not in dec_phases and "kv_import" in dec_phases
    assert_all_free(pre, dec)


def test_only_a_prefill_workers_pool_is_shared(tiny_model):
    """KV flows prefill -> decode only, so only a prefill worker's pool is in /dev/shm with
    a handle for peers. A decode or agg worker's stays in its process, zeroed, on memory
    advised for transparent huge pages (the `hg` flag): /dev/shm is often on 4 KB pages,
    where the decode attention's scattered reads took ~35% longer."""
    import mmap
    pre = make_engine(tiny_model, "prefill0", role="prefill", num_blocks=16)
    assert pre.kv.is_shared() and isinstance(pre.peer_handle(), bytes)
    for role in ("decode", "agg"):
        eng = make_engine(tiny_model, f"{role}0", role=role, num_blocks=16)
        assert not eng.kv.is_shared() and eng.peer_handle() is None, role
        assert eng.kv.is_contiguous() and float(eng.kv[:, :, :-1].abs().sum()) == 0.0
        # the canary block past the manager's ids holds its pattern, as in a shared pool
        assert torch.equal(eng.kv[:, :, -1], pre.kv[:, :, -1])
        if hasattr(mmap, "MADV_HUGEPAGE"):
            flags = vm_flags(eng.kv.data_ptr())
            assert flags is not None and " hg" in flags, (role, flags)


def test_cpu_pools_are_faulted_in_behind_the_steps(tiny_model):
    """A fresh worker's first write to each block page-faults (on a decode worker's
    huge-page pool, zeroing 2 MB a fault); its pool is faulted in by a background thread
    instead, which leaves what the pool holds alone, and the stats say when it is done."""
    for role in ("prefill", "decode"):
        eng = make_engine(tiny_model, f"{role}0", role=role, num_blocks=1024)
        populator = eng.kv_populator
        assert populator is not None and populator.finished.wait(120), role
        if populator.error is not None:
            pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {populator.error}")
        assert eng.stats().kv_populated == 1.0, role
        # resident before any block was written (only the canary block past the ids was)
        size = eng.kv.numel() * eng.kv.element_size()
        assert size > 8 << 20 and resident_bytes(eng.kv.data_ptr()) >= size - 4096, role
        # the canary, written before the thread started, is still there, the rest zero
        ref = make_engine(tiny_model, "ref", role=role, num_blocks=4)
        assert torch.equal(eng.kv[:, :, -1], ref.kv[:, :, -1]), role
        assert float(eng.kv[:, :, :-1].abs().sum()) == 0.0, role


def _fragment(eng: TorchEngine, seed: int) -> list[Sequence]:
    """Fill the pool with one-block sequences and free a random half: free blocks are
    then scattered holes. Returns the sequences still holding blocks."""
    rng = random.Random(seed)
    held = []
    while eng.blocks.available > 0:
        seq = Sequence(f"hold{len(held)}", [1] * BS, SamplingParams(max_tokens=1),
                       Role.PREFILL)
        eng.blocks.allocate(seq, use_cache=False)
        held.append(seq)
    rng.shuffle(held)
    for seq in held[: len(held) // 2]:
        eng.blocks.free(seq)
    return held[len(held) // 2:]


def test_disagg_handoff_between_fragmented_pools(tiny_model, prompts, reference):
    """Sources scattered over holes, destinations taken as the longest free runs: the
    copy gathers blocks into runs (kv.blocks.copy_blocks) and the output is unchanged."""
    pre = make_engine(tiny_model, "prefill0", role="prefill", num_blocks=48)
    dec = make_engine(tiny_model, "decode0", role="decode", num_blocks=48)
    dec.attach_peer(pre.worker, pre.peer_handle())
    held = {pre.worker: _fragment(pre, 1), dec.worker: _fragment(dec, 2)}
    copies: list[tuple[list[int], list[int]]] = []
    import_kv = dec.import_kv

    def spy(seqs):
        for seq in seqs:
            n = len(seq.handle.block_ids)
            copies.append((list(seq.handle.block_ids), seq.block_table[:n]))
        import_kv(seqs)

    dec.import_kv = spy
    first, later = split(prompts)
    out, _, _ = run_disagg(pre, dec, first, later)
    for name in prompts:
        assert out[name] == reference[name], name

    def consecutive(ids):
        return ids == list(range(ids[0], ids[0] + len(ids)))

    multi = [(s, d) for s, d in copies if len(s) > 1]
    assert multi, copies
    assert any(not consecutive(s) for s, _ in multi), copies     # gathered sources
    for _, d in copies:                                         # destinations ascending
        assert d == sorted(d), copies
    for eng in (pre, dec):
        for seq in held[eng.worker]:
            eng.blocks.free(seq)
    assert_all_free(pre, dec)


def test_handed_off_blocks_freed_by_sweep_when_never_acknowledged(tiny_model, prompts):
    pre = make_engine(tiny_model, "prefill1", num_blocks=32, role="prefill")
    assert pre.add(Prefill("r", prompts["long"], GREEDY, handoff=True)) == []
    done = [e for e in pre.step() if isinstance(e, PrefillDone)]
    assert done and done[0].handle is not None
    assert pre.stats().kv_blocks_handed_off == len(done[0].handle.block_ids)
    pre.sweep(now=1e18)
    assert_all_free(pre)


# --------------------------------------------------------------------------- (c) seeds


CHUNK = 12      # not a divisor of the block size: chunks end inside blocks


def test_chunked_prefill_matches_transformers(tiny_model, prompts, reference):
    eng = make_engine(tiny_model, "chunk0", chunk=CHUNK)
    first, later = split(prompts)
    out, cached, records = run_agg(eng, first, later)
    for name in prompts:
        assert out[name] == reference[name], name
    assert cached["prefB"] == 2 * BS           # prefA's blocks were committed chunk by chunk
    # Entries up to a prompt's length are its chunks; decode entries come after it.
    chunks: dict[str, list[tuple[int, int]]] = {}
    for r in records:
        prompt_tokens = 0
        for rid, n, ctx in r.entries:
            if r.phase != "kv_import" and ctx <= len(prompts[rid]):
                chunks.setdefault(rid, []).append((n, ctx))
                prompt_tokens += n
        assert prompt_tokens <= CHUNK, r
    # Each prompt's chunks cover it exactly once (less prefB's cached blocks), the last
    # ends at the prompt's end, and a prompt longer than a chunk took several steps.
    for name, p in prompts.items():
        got = chunks[name]
        assert sum(n for n, _ in got) == len(p) - cached[name], (name, got)
        assert got[-1][1] == len(p) and len(got) >= -(-(len(p) - cached[name]) // CHUNK)
    # Once something decodes, prompt chunks ride in the decode steps (mixed batches).
    phases = [r.phase for r in records]
    first_decode = next(i for i, p in enumerate(phases) if p in ("decode", "mixed"))
    assert "mixed" in phases and "prefill" not in phases[first_decode:]
    assert_all_free(eng)


def test_chunked_prefill_hands_off_and_keeps_seeded_streams(tiny_model, prompts):
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99)
    plain, _, _ = run_agg(make_engine(tiny_model, "c0"), {"x": prompts["long"]}, {},
                          {"x": seeded})
    chunked, _, _ = run_agg(make_engine(tiny_model, "c1", chunk=CHUNK),
                            {"x": prompts["long"], "a": prompts["short"]}, {},
                            {"x": seeded})
    assert chunked["x"] == plain["x"]           # chunks draw no samples
    pre = make_engine(tiny_model, "c2", role="prefill", chunk=CHUNK)
    dec = make_engine(tiny_model, "c3", role="decode")
    dec.attach_peer(pre.worker, pre.peer_handle())
    split_out, _, _ = run_disagg(pre, dec, {"x": prompts["long"], "a": prompts["short"]}, {},
                                 {"x": seeded})
    assert split_out["x"] == plain["x"]
    assert_all_free(pre, dec)


def test_seeded_sampling_independent_of_batch(tiny_model, prompts):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    eng = make_engine(tiny_model, "s0")
    alone, _, _ = run_agg(eng, {"x": prompts["long"]}, {}, {"x": seeded})

    eng2 = make_engine(tiny_model, "s1")
    mixed, _, _ = run_agg(
        eng2, {"a": prompts["short"], "b": prompts["prefA"]},
        {"x": prompts["long"], "c": prompts["block"]},
        {"x": seeded, "a": other, "b": GREEDY, "c": other})
    assert mixed["x"] == alone["x"]

    # Disaggregated: the decode worker continues the same random stream.
    pre = make_engine(tiny_model, "s2", role="prefill")
    dec = make_engine(tiny_model, "s3", role="decode")
    dec.attach_peer(pre.worker, pre.peer_handle())
    split_out, _, _ = run_disagg(pre, dec, {"x": prompts["long"], "a": prompts["short"]}, {},
                                 {"x": seeded, "a": other})
    assert split_out["x"] == alone["x"]

    reseeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1235)
    different, _, _ = run_agg(eng, {"x": prompts["long"]}, {}, {"x": reseeded})
    assert different["x"] != alone["x"]


def reference_with_controls(model, prompt: list[int], p: SamplingParams):
    """Greedy decoding written out over transformers' logits with OpenAI's formulas:
    logit_bias added, then ``c[j] * frequency + (c[j] > 0) * presence`` taken off, c the
    counts of generated tokens; logprobs from the raw logits."""
    ids, out, lps = list(prompt), [], []
    bias = torch.zeros(model.config.vocab_size)
    for t, b in p.logit_bias:
        bias[t] += b
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.numel()).float()
            adjusted = (logits + bias - counts * p.frequency_penalty
                        - (counts > 0).float() * p.presence_penalty)
            tok = int(adjusted.argmax())
            lp = torch.log_softmax(logits, -1)
            lps.append((float(lp[tok]), lp.argsort(descending=True)[: p.logprobs or 0].tolist()))
            out.append(tok)
            ids.append(tok)
    return out, lps


def test_penalties_bias_and_logprobs_match_a_reference(tiny_model, prompts):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = prompts["long"]
    # The random model's logits lie within ~2 of each other: a bias of 2 makes token X
    # win (nearly) every step, and penalties of 2 take that back once X was said.
    x = 77
    biased = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((x, 2.0),), logprobs=3)
    penalized = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((x, 2.0),),
                               frequency_penalty=1.5, presence_penalty=0.5, logprobs=3)
    ref_b, _ = reference_with_controls(model, prompt, biased)
    ref_p, ref_lps = reference_with_controls(model, prompt, penalized)
    assert ref_b.count(x) > 5 and ref_p.count(x) == 1, (ref_b, ref_p)   # they do something

    lps: dict = {}
    out, _, _ = run_agg(make_engine(tiny_model, "pen0"), {"b": prompt, "p": prompt}, {},
                        {"b": biased, "p": penalized}, lps)
    assert out["b"] == ref_b and out["p"] == ref_p
    assert len(lps["p"]) == len(ref_p)
    for (lp, alts), (ref_lp, ref_top) in zip(lps["p"], ref_lps):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert [t for t, _ in alts] == ref_top

    # Disaggregated: the first token's logprobs come from the prefill worker, and the
    # decode worker counts that token in its penalties.
    pre = make_engine(tiny_model, "pen1", role="prefill")
    dec = make_engine(tiny_model, "pen2", role="decode")
    dec.attach_peer(pre.worker, pre.peer_handle())
    split_lps: dict = {}
    split_out, _, _ = run_disagg(pre, dec, {"p": prompt}, {}, {"p": penalized}, split_lps)
    assert split_out["p"] == ref_p
    assert [t for _, t in split_lps["p"]] == [alts for _, alts in lps["p"]]
    assert_all_free(pre, dec)


def test_prompt_logprobs_match_transformers_whatever_the_path(tiny_model, prompts):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = prompts["prefA"]                                # 40 tokens: 2 full blocks
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    want = [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    want_top = [ref[p].argsort(descending=True)[:2].tolist() for p in range(len(prompt) - 1)]
    asked = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)

    def check(plps, cached):
        assert plps[0] is None and len(plps) == len(prompt)
        assert [lp for lp, _ in plps[1:]] == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in alts] for _, alts in plps[1:]] == want_top
        assert cached == 0           # scored from scratch, not served from the cache

    def first_events(eng, name):
        out = []
        while eng.has_work():
            out += [ev for ev in eng.step() if isinstance(ev, (Tokens, PrefillDone))
                    and ev.request_id == name]
        return out

    for chunk in (0, 12):       # 12-token chunks end inside blocks and carry over
        eng = make_engine(tiny_model, f"pl{chunk}", chunk=chunk)
        run_agg(eng, {"warm": prompt}, {})                # the prompt's blocks are cached now
        eng.add(Prefill("x", prompt, asked, handoff=False))
        evs = first_events(eng, "x")
        check(evs[0].prompt_logprobs, evs[0].cached_tokens)
        assert all(ev.prompt_logprobs is None for ev in evs[1:])
        assert_all_free(eng)

    pre = make_engine(tiny_model, "pl-p", role="prefill")
    pre.add(Prefill("x", prompt, asked, handoff=True))
    (done,) = first_events(pre, "x")
    check(done.prompt_logprobs, done.cached_tokens)
    pre.release("x")
    assert_all_free(pre)


def test_invalid_requests_fail_without_touching_the_engine(tiny_model):
    eng = make_engine(tiny_model, "v0", num_blocks=16)
    bad_t = SamplingParams(max_tokens=4, temperature=-1.0)
    (ev,) = eng.add(Prefill("t", [0, 5, 6], bad_t, handoff=False))
    assert isinstance(ev, RequestFailed) and ev.code == "invalid_request"
    (ev,) = eng.add(Prefill("e", [], GREEDY, handoff=False))
    assert ev.code == "invalid_request"
    (ev,) = eng.add(Prefill("v", [0, 10**6], GREEDY, handoff=False))
    assert ev.code == "invalid_request"
    (ev,) = eng.add(Prefill("c", [5] * (eng.max_context + 1), GREEDY, handoff=False))
    assert ev.code == "context_length_exceeded"
    huge_seed = SamplingParams(max_tokens=4, temperature=1.0, seed=2**70)
    (ev,) = eng.add(Prefill("s", [0, 5, 6], huge_seed, handoff=False))
    assert ev.code == "invalid_request"
    (ev,) = eng.add(Prefill("b", [0, 5], SamplingParams(max_tokens=4, logit_bias=((4096, 1.0),)),
                            handoff=False))
    assert ev.code == "invalid_request" and "vocabulary" in ev.message
    assert not eng.has_work()
    assert_all_free(eng)


# --------------------------------------------------------------------------- (d) layout


def test_layout_mismatch_is_refused(tiny_model, prompts):
    pre = make_engine(tiny_model, "l0", num_blocks=32, role="prefill")
    other = make_engine(tiny_model, "l1", num_blocks=64, block_size=8, role="decode")
    other.attach_peer(pre.worker, pre.peer_handle())
    assert pre.add(Prefill("r", prompts["long"], GREEDY, handoff=True)) == []
    (done,) = [e for e in pre.step() if isinstance(e, PrefillDone)]
    assert done.handle.layout != other.layout()

    (ev,) = other.add(Decode("r", prompts["long"], done.first_token, GREEDY, done.handle))
    assert isinstance(ev, RequestFailed) and ev.code == "kv_layout_mismatch"

    # A handle that claims the right layout for a pool that has another one: the import
    # checks the attached pool itself and refuses (never reinterprets the bytes).
    h = done.handle
    lying = KvHandle(h.worker, h.request_id, h.block_ids, h.num_tokens, other.layout())
    assert other.add(Decode("r", prompts["long"], done.first_token, GREEDY, lying)) == []
    (ev,) = [e for e in other.step() if isinstance(e, RequestFailed)]
    assert ev.code == "kv_import_failed" and "pool of l0" in ev.message

    # A source whose pool was never attached: a clear error, not a crash.
    same = make_engine(tiny_model, "l2", num_blocks=32, role="decode")
    assert same.add(Decode("r", prompts["long"], done.first_token, GREEDY, h)) == []
    (ev,) = [e for e in same.step() if isinstance(e, RequestFailed)]
    assert ev.code == "kv_import_failed" and "no KV pool of source worker 'l0'" in ev.message

    pre.release("r")
    assert_all_free(pre, other, same)


# --------------------------------------------------------------------------- (e) preemption


def test_preemption_by_recompute_keeps_greedy_output(tiny_model, prompts, reference):
    # 8 blocks of 16 tokens for five requests needing 2-5 blocks each: decode runs out of
    # blocks and preempts (reserve_ratio=0 admits without a decode reservation).
    eng = make_engine(tiny_model, "p0", num_blocks=8, reserve_ratio=0.0)
    first, later = split(prompts)
    out, _, _ = run_agg(eng, first, later)
    assert eng.scheduler.preemptions > 0
    for name in prompts:
        assert out[name] == reference[name], name
    assert_all_free(eng)
