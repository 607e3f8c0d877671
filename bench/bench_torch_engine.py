"""Torch engine vs transformers `generate`, fp32 (or `--dtype bfloat16`), the same thread
count on both sides (one by default, `--threads N`), on the generated models; and the KV
handoff's bandwidth. Not a test: prints tables.

    .venv/bin/python bench/bench_torch_engine.py            # full run (~3-4 min on 2 cores)
    .venv/bin/python bench/bench_torch_engine.py --quick    # smoke run (~1 min)
    .venv/bin/python bench/bench_torch_engine.py --dtype bfloat16   # both sides in bf16

Decode tok/s: B requests of P prompt tokens, greedy, N new tokens each, EOS ignored.
  engine: decode tokens / wall time of the engine's decode iterations (IterationRecords).
  transformers: B*(N-1) / the time from its first logits (end of the prompt's pass) to
  the end of generate(N new), the same prompts, no padding (all prompts have the same
  length), its default KV cache and attention. P = 64 at B = 1, 8, 32, and P = 1,024 at
  B = 8 (long context: attention, not the weights, dominates a step).
Prefill tok/s: engine prefill iteration vs generate(max_new_tokens=1) on the same prompts.
Trace-shaped: the first rows of the Azure code trace (mixed prompt and output lengths)
through the engine (continuous batching, at most B running) and through `generate` in
batches of B (static batching with left padding): what batching and paged KV buy.
KV handoff: the blocks of a 2,048-token prompt copied with copy_blocks from a pool that a
second, exec'd process exported (/dev/shm) into that process's own pool, vs a plain torch
copy of the same number of bytes inside that process, every copy timed with nothing of
it in cache (a 64 MiB buffer written first; median), and the plain copy also repeated
warm (min; source and destination stay in L3); and the decode engine's whole kv_import
iteration as a share of the prefill time of that prompt.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines.messages import (  # noqa: E402
    Decode, IterationRecord, KvImported, Prefill, PrefillDone, SamplingParams,
)
from appliance.engines.block_manager import BlockManager  # noqa: E402
from appliance.engines.cpu_heap import keep_freed_memory  # noqa: E402
from appliance.engines.sequence import Role, Sequence  # noqa: E402
from appliance.engines.torch_engine import TorchEngine  # noqa: E402
from appliance.engines.kv_pool import kv_pool_bytes_per_block  # noqa: E402
from appliance.engines.loader import load_model  # noqa: E402
from appliance.kv.handoff import allocate_pool, export_pool  # noqa: E402

BS = 16
DTYPE = torch.float32       # --dtype: weights and KV of both sides


def engine(model, worker: str, num_blocks: int, max_seqs: int = 256,
           max_batch_tokens: int = 65536) -> TorchEngine:
    return TorchEngine(model=model, worker=worker, devices=("cpu",), num_blocks=num_blocks,
                       block_size=BS, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                       max_context=model.shape.max_position_embeddings, eos_token_ids=())


def prompts_for(batch: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(5, vocab, (length - 1,), generator=g).tolist()
            for _ in range(batch)]


def run_engine(model, prompts, new_tokens: int):
    """(prefill wall s, decode wall s, decode tokens, outputs): every prompt at once."""
    r = engine_serves(model, [(p, new_tokens) for p in prompts], max_seqs=256,
                      max_batch_tokens=65536)
    return r["prefill"], r["decode"], r["decode_tokens"], r["outs"]


class FirstLogits:
    """A `generate` logits processor that marks the end of the prefill pass: it is called
    once per new token, first right after the prompt's forward pass."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def hf_generate(hf, prompts, new_tokens: int):
    """(prefill s, decode s, outputs) of one `generate` call on equal-length prompts. Both
    times come from the same run (split at FirstLogits), not from the difference of two
    runs, which long prompts' prefill time would drown in noise."""
    import transformers

    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    gc.max_new_tokens = new_tokens
    ids = torch.tensor(prompts)
    mark = FirstLogits()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                          logits_processor=transformers.LogitsProcessorList([mark]))
    t1 = time.perf_counter()
    return mark.at - t0, t1 - mark.at, out[:, ids.shape[1]:].tolist()


def med(xs):
    return statistics.median(xs)


def bench_model(model_dir: Path, preset: str, a) -> list[dict]:
    import transformers

    model = load_model(model_dir, dtype=DTYPE)
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
    vocab = model.shape.vocab_size
    rows = []
    # Warm-up both paths (first-call allocations, kernel selection).
    run_engine(model, prompts_for(2, 20, 99, vocab), 4)
    hf_generate(hf, prompts_for(2, 20, 99, vocab), 4)

    for batch, prompt in a.decode_cases:
        ours, theirs = [], []
        match = None
        for rep in range(a.reps):
            ps = prompts_for(batch, prompt, rep, vocab)
            _, dec, ntok, outs = run_engine(model, ps, a.new)
            ours.append(ntok / dec)
            _, hf_dec, hf_outs = hf_generate(hf, ps, a.new)
            theirs.append(batch * (a.new - 1) / hf_dec)
            if rep == 0:
                match = sum(o == h for o, h in zip(outs, hf_outs))
        what = f"decode b={batch}" + ("" if prompt == a.prompt else f", {prompt}-tok prompt")
        rows.append(dict(model=preset, what=what, ours=med(ours), hf=med(theirs),
                         note=f"greedy equal {match}/{batch}"))

    for batch, length in ((1, 2048), (4, 512)):
        ours, theirs = [], []
        for rep in range(a.reps):
            ps = prompts_for(batch, length, 100 + rep, vocab)
            pre, _, _, _ = run_engine(model, ps, 1)
            ours.append(batch * length / pre)
            t, _, _ = hf_generate(hf, ps, 1)
            theirs.append(batch * length / t)
        rows.append(dict(model=preset, what=f"prefill {batch}x{length}", ours=med(ours),
                         hf=med(theirs), note=""))
    return rows


def trace_requests(count: int, prompt_scale: float, max_out: int, vocab: int):
    """The first `count` requests of the Azure code trace: (prompt ids, output length)."""
    from bench_trace import TRACE, load_trace
    g = torch.Generator().manual_seed(11)
    reqs = []
    for _, p, o in load_trace(TRACE, 0, count):
        n = max(2, int(p * prompt_scale))
        reqs.append(([0] + torch.randint(5, vocab, (n - 1,), generator=g).tolist(),
                     max(1, min(o, max_out))))
    return reqs


def engine_serves(model, reqs, max_seqs: int, max_batch_tokens: int = 8192,
                  params: SamplingParams | None = None) -> dict:
    """All requests queued at once; the engine keeps at most `max_seqs` running
    (continuous batching; by default the daemon's prefill budget of 8,192 tokens).
    `params`: the sampling of every request (greedy, each its own length, by default)."""
    need = sum(-(-(len(p) + o) // BS) for p, o in reqs)
    eng = engine(model, "bench", need + 8, max_seqs=max_seqs,
                 max_batch_tokens=max_batch_tokens)
    for i, (p, o) in enumerate(reqs):
        sp = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        if params is not None:
            sp = dataclasses.replace(params, max_tokens=o, ignore_eos=True)
        eng.add(Prefill(f"r{i}", p, sp, handoff=False))
    pre = dec = 0.0
    dec_tok = 0
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, IterationRecord):
                if ev.phase == "prefill":
                    pre += ev.wall_s
                else:
                    dec += ev.wall_s
                    dec_tok += len(ev.entries)
            elif hasattr(ev, "tokens"):
                outs.setdefault(ev.request_id, []).extend(ev.tokens)
    wall = time.perf_counter() - t0
    return dict(wall=wall, prefill=pre, decode=dec, decode_tokens=dec_tok,
                outs=[outs[f"r{i}"] for i in range(len(reqs))])


def hf_serves(hf, reqs, batch: int) -> dict:
    """transformers `generate` on the same requests in arrival order, `batch` at a time:
    prompts left-padded to the longest in the batch, each batch generating as many tokens
    as its longest request needs (static batching: what `generate` can do)."""
    import transformers

    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    wall = pre = 0.0
    outs = []
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        gc.max_new_tokens = max(o for _, o in chunk)
        mark = FirstLogits()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=gc,
                              logits_processor=transformers.LogitsProcessorList([mark]))
        t1 = time.perf_counter()
        wall += t1 - t0
        pre += mark.at - t0
        outs += [row[width:width + o] for row, (_, o) in zip(out.tolist(), chunk)]
    return dict(wall=wall, prefill=pre, decode=wall - pre, outs=outs)


def bench_workload(model_dir: Path, preset: str, a) -> list[dict]:
    """Trace-shaped requests (mixed prompt and output lengths), the same set through the
    engine (at most B running) and through `generate` (batches of B)."""
    import transformers

    model = load_model(model_dir, dtype=DTYPE)
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
    rows = []
    for batch in a.batches:
        reqs = trace_requests(max(a.min_requests, 2 * batch), a.prompt_scale, a.max_out,
                              model.shape.vocab_size)
        ours = engine_serves(model, reqs, batch)
        theirs = hf_serves(hf, reqs, batch)
        out_tok = sum(o for _, o in reqs)
        prompt_tok = sum(len(p) for p, _ in reqs)
        match = sum(x == y for x, y in zip(ours["outs"], theirs["outs"]))
        rows.append(dict(
            model=preset, batch=batch, requests=len(reqs), prompt_tok=prompt_tok,
            out_tok=out_tok, ours_e2e=out_tok / ours["wall"], hf_e2e=out_tok / theirs["wall"],
            ours_dec=ours["decode_tokens"] / ours["decode"],
            hf_dec=(out_tok - len(reqs)) / theirs["decode"],
            ours_pre=prompt_tok / ours["prefill"], hf_pre=prompt_tok / theirs["prefill"],
            match=match))
    return rows


SAMPLING = {
    "greedy": SamplingParams(max_tokens=1, temperature=0.0),
    "temperature 0.8, top-k 50, top-p 0.95": SamplingParams(
        max_tokens=1, temperature=0.8, top_k=50, top_p=0.95, seed=1),
    "greedy + penalties + 16 logit_bias": SamplingParams(
        max_tokens=1, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3,
        logit_bias=tuple((t, 1.0) for t in range(100, 116))),
    "greedy + logprobs (top 5)": SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
    "greedy + prompt logprobs (echo, top 1)": SamplingParams(max_tokens=1, temperature=0.0,
                                                             prompt_logprobs=1),
}


def bench_sampling(model_dir: Path, preset: str, a) -> list[dict]:
    """The cost of the sampling controls: the same requests (B at once, 256-token prompts)
    with each setting; engine decode and prefill tok/s, median of the repetitions."""
    model = load_model(model_dir, dtype=DTYPE)
    rows = []
    for batch in (1, 8):
        reqs = [(p, a.new) for p in prompts_for(batch, 256, 5, model.shape.vocab_size)]
        engine_serves(model, reqs[:1], max_seqs=batch)        # warm-up
        # Settings interleaved within each repetition, so that a slow spell of this
        # shared machine does not land on one setting.
        runs: dict[str, list[dict]] = {name: [] for name in SAMPLING}
        for _ in range(max(3, a.reps)):
            for name, params in SAMPLING.items():
                runs[name].append(engine_serves(model, reqs, max_seqs=batch, params=params))
        for name, rs in runs.items():
            rows.append(dict(model=preset, batch=batch, what=name,
                             dec=med([r["decode_tokens"] / r["decode"] for r in rs]),
                             pre=med([256 * batch / r["prefill"] for r in rs])))
    return rows


PEER = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from appliance.kv.handoff import allocate_pool, copy_from_peer, import_pool
shape = tuple(json.loads(sys.argv[2])); reps = int(sys.argv[3])
handle = sys.stdin.buffer.read()
src = import_pool(handle).tensor
dst = allocate_pool(shape, torch.float32)
nblk = int(sys.argv[4])
g = torch.Generator().manual_seed(0)
src_ids = torch.randperm(shape[2], generator=g)[:nblk].tolist()   # scattered: worst case
dst_ids = torch.randperm(shape[2], generator=g)[:nblk].tolist()
churn_src, churn_dst = json.loads(sys.argv[5])   # what the block managers hand out
nbytes = nblk * src[:, :, 0].numel() * 4
t0 = time.perf_counter()
copy_from_peer(src, src_ids, dst, dst_ids)
first = time.perf_counter() - t0
ok = all(torch.equal(src[:, :, s], dst[:, :, d]) for s, d in zip(src_ids, dst_ids))
scratch = torch.empty(16 << 20)   # 64 MiB, twice the L3 of the dev machine
def cold(fn):
    # Median time of fn with nothing of it in cache (scratch written over the cache
    # first): the handoff's source was written by another process's prefill, not just
    # now by this core, and the plain copy must not be luckier.
    ts = []
    for _ in range(reps):
        scratch.fill_(1.0)
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
t_blocks = cold(lambda: copy_from_peer(src, src_ids, dst, dst_ids))
seq_src, seq_dst = list(range(nblk)), list(range(nblk, 2 * nblk))   # fresh pools: runs
copy_from_peer(src, seq_src, dst, seq_dst)
t_runs = cold(lambda: copy_from_peer(src, seq_src, dst, seq_dst))
copy_from_peer(src, churn_src, dst, churn_dst)
t_churn = cold(lambda: copy_from_peer(src, churn_src, dst, churn_dst))
a = torch.randn(nbytes // 4); b = torch.empty_like(a); b.copy_(a)
t_plain = cold(lambda: b.copy_(a))
warm = []
for _ in range(reps):   # the same copy again and again: source and destination stay in L3
    t0 = time.perf_counter(); b.copy_(a); warm.append(time.perf_counter() - t0)
print(json.dumps(dict(bytes=nbytes, first=first, blocks=t_blocks, runs=t_runs, churn=t_churn,
                      plain=t_plain, plain_warm=min(warm), ok=ok)))
"""


def churned_block_ids(num_blocks: int, tokens: int, seed: int, importing: bool,
                      occupancy: float = 0.8) -> list[int]:
    """The block ids a real BlockManager gives a `tokens`-long prompt in a pool that has
    been ~`occupancy` full for a long time: requests of 1-1,200 tokens admitted and
    finished in random order until every block has been handed out ~10 times. As the
    prefill worker allocates a prompt (LRU, ascending), or as the decode worker allocates
    a KV import (`importing`: one free run if there is one, else the longest runs)."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, reserve_ratio=0.0)
    live: list[Sequence] = []
    params = SamplingParams(max_tokens=1)

    def drop_one() -> None:
        bm.free(live.pop(rng.randrange(len(live))))

    handed_out = i = 0
    while handed_out < 10 * num_blocks:
        i += 1
        if live and bm.num_free < (1 - occupancy) * num_blocks:
            drop_one()
            continue
        seq = Sequence(f"c{i}", [rng.randrange(50_000) for _ in range(rng.randint(1, 1200))],
                       params, Role.PREFILL)
        if not bm.can_admit(seq):
            drop_one()
            continue
        bm.allocate(seq)
        handed_out += len(seq.block_table)
        seq.num_cached = len(seq.tokens)
        bm.commit(seq)
        live.append(seq)
    final = Sequence("final", [rng.randrange(50_000) for _ in range(tokens)], params,
                     Role.DECODE if importing else Role.PREFILL)
    while not bm.can_admit(final, use_cache=False):
        drop_one()
    bm.allocate(final, use_cache=False, run=importing)
    return final.block_table


def bench_handoff(model_dir: Path, preset: str, a) -> dict:
    model = load_model(model_dir, dtype=DTYPE)
    s = model.shape
    tokens = 2048
    nblk = tokens // BS
    # The daemon's default pool: 1 GiB per worker on the CPU.
    pool_blocks = (1 << 30) // kv_pool_bytes_per_block(s, BS, torch.float32)
    shape = (2, s.num_layers, pool_blocks, BS, s.num_kv_heads, s.head_dim)
    pool = allocate_pool(shape, torch.float32)
    pool.normal_()
    handle = export_pool(pool)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    churn = [churned_block_ids(pool_blocks, tokens, 1, importing=False),
             churned_block_ids(pool_blocks, tokens, 2, importing=True)]
    r = subprocess.run([sys.executable, "-c", PEER, str(ROOT), json.dumps(shape),
                        str(max(3, a.reps * 5)), str(nblk), json.dumps(churn)],
                       input=handle, capture_output=True, env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.decode()[-2000:])
    x = json.loads(r.stdout)

    # The whole handoff inside the engines: prefill on A, kv_import iteration on B. Twice,
    # timing the second: the first also pays the page faults of fresh pools.
    pre_eng = engine(model, "A", nblk + 8)
    dec_eng = engine(model, "B", nblk + 8)
    dec_eng.attach_peer("A", pre_eng.peer_handle())
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for rid in ("warm", "timed"):
        prompt = prompts_for(1, tokens, 7 if rid == "warm" else 8, s.vocab_size)[0]
        pre_eng.add(Prefill(rid, prompt, params, handoff=True))
        prefill_s = import_s = 0.0
        for ev in pre_eng.step():
            if isinstance(ev, IterationRecord):
                prefill_s = ev.wall_s
            elif isinstance(ev, PrefillDone):
                done = ev
        dec_eng.add(Decode(rid, prompt, done.first_token, params, done.handle))
        while dec_eng.has_work():
            for ev in dec_eng.step():
                if isinstance(ev, IterationRecord) and ev.phase == "kv_import":
                    import_s = ev.wall_s
                elif isinstance(ev, KvImported):
                    pre_eng.release(rid)
    return dict(model=preset, bytes=x["bytes"], gbps_blocks=x["bytes"] / x["blocks"] / 1e9,
                gbps_plain=x["bytes"] / x["plain"] / 1e9,
                gbps_plain_warm=x["bytes"] / x["plain_warm"] / 1e9,
                gbps_runs=x["bytes"] / x["runs"] / 1e9,
                gbps_churn=x["bytes"] / x["churn"] / 1e9, first_ms=x["first"] * 1e3,
                copy_ms=x["blocks"] * 1e3, ok=x["ok"], prefill_ms=prefill_s * 1e3,
                import_ms=import_s * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    ap.add_argument("--presets", default="tiny,20m")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (a CPU worker runs as many as it has cores)")
    ap.add_argument("--parts", default="equal,trace,handoff",
                    help="comma list of: equal (same-shape batches), trace (trace-shaped "
                         "requests), handoff, sampling (the cost of the sampling controls; "
                         "not in the default run)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights and KV of the engine and of transformers (bf16 is native "
                         "only on CPUs with AVX512-BF16/AMX; see engines/dtypes.py)")
    a = ap.parse_args()
    global DTYPE
    DTYPE = getattr(torch, a.dtype)
    parts = set(a.parts.split(","))
    if DTYPE != torch.float32 and "handoff" in parts:
        print("(the handoff part measures fp32 pools: left out with --dtype)")
        parts.discard("handoff")
    a.batches = (1, 8, 32)
    a.prompt, a.new, a.reps = (32, 16, 1) if a.quick else (64, 48, 3)
    # (batch, prompt tokens): the three batch sizes at short context, and one long context
    a.decode_cases = [(b, a.prompt) for b in a.batches] + [(4, 256) if a.quick else (8, 1024)]
    a.min_requests, a.prompt_scale, a.max_out = (8, 0.0625, 64) if a.quick else (16, 0.125, 256)
    torch.set_num_threads(a.threads)
    # What a CPU worker does at start-up (build_torch_engine). It is process-wide, so
    # `generate` in this process runs with the same malloc settings.
    keep_freed_memory()
    from appliance.models.tiny import init_tiny

    t_start = time.perf_counter()
    rows, handoffs, work, sampling = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets.split(","):
            d = init_tiny(Path(tmp) / preset, seed=0, preset=preset)
            if "equal" in parts:
                rows += bench_model(d, preset, a)
            if "trace" in parts:
                work += bench_workload(d, preset, a)
            if "handoff" in parts:
                handoffs.append(bench_handoff(d, preset, a))
            if "sampling" in parts:
                sampling += bench_sampling(d, preset, a)

    print(f"\ntorch {torch.__version__}, threads={torch.get_num_threads()}, {a.dtype}, "
          f"prompt={a.prompt} new={a.new} reps={a.reps} (median)")
    print("ratio = engine / HF generate at the same batch; vs HF b=1 = engine / HF serving "
          "the same requests one at a time (batch 1)")
    print(f"{'model':<6} {'measure':<28} {'engine tok/s':>13} {'HF generate':>12} "
          f"{'ratio':>6} {'vs HF b=1':>10}  note")
    for r in rows:
        b1 = next((x["hf"] for x in rows if x["model"] == r["model"]
                   and x["what"] == "decode b=1"), None)
        vs1 = " " * 10
        if b1 and r["what"].startswith("decode") and "prompt" not in r["what"]:
            vs1 = f"{r['ours'] / b1:>10.2f}"
        print(f"{r['model']:<6} {r['what']:<28} {r['ours']:>13.0f} {r['hf']:>12.0f} "
              f"{r['ours'] / r['hf']:>6.2f} {vs1}  {r['note']}")
    if work:
        print(f"\nTrace-shaped requests: the first N rows of the Azure code trace, prompts "
              f"x{a.prompt_scale} (random ids), outputs as in the trace (capped at "
              f"{a.max_out}), EOS ignored, all queued at once. engine = continuous batching, "
              "at most B running; HF = generate on batches of B in arrival order (left "
              "padding, each batch runs to its longest output). tok/s counts each request's "
              "own tokens only. e2e = output tokens / total wall time.")
        print(f"{'model':<6} {'B':>3} {'N':>4} {'prompt tok':>10} {'out tok':>8} "
              f"{'e2e ours':>9} {'e2e HF':>8} {'ratio':>6} {'decode ours':>12} "
              f"{'decode HF':>10} {'ratio':>6} {'prefill ours':>13} {'prefill HF':>11} "
              f"{'ratio':>6}  greedy equal")
        for w in work:
            print(f"{w['model']:<6} {w['batch']:>3} {w['requests']:>4} {w['prompt_tok']:>10} "
                  f"{w['out_tok']:>8} {w['ours_e2e']:>9.0f} {w['hf_e2e']:>8.0f} "
                  f"{w['ours_e2e'] / w['hf_e2e']:>6.2f} {w['ours_dec']:>12.0f} "
                  f"{w['hf_dec']:>10.0f} {w['ours_dec'] / w['hf_dec']:>6.2f} "
                  f"{w['ours_pre']:>13.0f} {w['hf_pre']:>11.0f} "
                  f"{w['ours_pre'] / w['hf_pre']:>6.2f}  {w['match']}/{w['requests']}")
    if sampling:
        print(f"\nSampling controls: B requests of 256 prompt tokens, {a.new} new tokens, "
              "engine tok/s (median) and the ratio to greedy at the same B")
        print(f"{'model':<6} {'B':>3} {'setting':<40} {'decode tok/s':>13} {'ratio':>6} "
              f"{'prefill tok/s':>14} {'ratio':>6}")
        for r in sampling:
            g = next(x for x in sampling if x["model"] == r["model"]
                     and x["batch"] == r["batch"] and x["what"] == "greedy")
            print(f"{r['model']:<6} {r['batch']:>3} {r['what']:<40} {r['dec']:>13.0f} "
                  f"{r['dec'] / g['dec']:>6.2f} {r['pre']:>14.0f} {r['pre'] / g['pre']:>6.2f}")
    if not handoffs:
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
        return 0
    print("\nKV handoff of a 2,048-token prompt (128 blocks of 16), exported pool in another "
          "process (/dev/shm)")
    print("scattered = 128 random block ids on both sides (worst case), runs = consecutive "
          "ids (fresh pools), churned = the ids real BlockManagers hand out in the daemon's "
          "default 1 GiB pool after it has been ~80% full for a long time (source: a prompt "
          "on the prefill worker, LRU; destination: the decode worker's import, free runs); "
          "plain = one contiguous torch copy of as many bytes; all of these with nothing "
          "in cache (median); warm = the plain copy repeated with source and destination "
          "in L3 (min); first = the first scattered copy (page faults of a fresh mapping); "
          "kv_import = the decode engine's whole "
          "import iteration (in-process pools, after one handoff warmed them)")
    print(f"{'model':<6} {'MiB':>6} {'scattered GB/s':>15} {'runs GB/s':>10} {'churned GB/s':>13} "
          f"{'plain GB/s':>11} {'warm GB/s':>10} {'scat/plain':>11} {'churn/plain':>12} "
          f"{'churn/warm':>11} {'first ms':>9} "
          f"{'kv_import ms':>13} {'prefill ms':>11} "
          f"{'import/prefill':>15}")
    for h in handoffs:
        print(f"{h['model']:<6} {h['bytes'] / 2**20:>6.1f} {h['gbps_blocks']:>15.2f} "
              f"{h['gbps_runs']:>10.2f} {h['gbps_churn']:>13.2f} {h['gbps_plain']:>11.2f} "
              f"{h['gbps_plain_warm']:>10.2f} {h['gbps_blocks'] / h['gbps_plain']:>11.0%} "
              f"{h['gbps_churn'] / h['gbps_plain']:>12.0%} "
              f"{h['gbps_churn'] / h['gbps_plain_warm']:>11.0%} "
              f"{h['first_ms']:>9.2f} {h['import_ms']:>13.2f} {h['prefill_ms']:>11.1f} "
              f"{h['import_ms'] / h['prefill_ms']:>15.2%}" + ("" if h["ok"] else "  DATA MISMATCH"))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
