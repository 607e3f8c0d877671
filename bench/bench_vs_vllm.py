"""applianced against vLLM's CPU build on the same checkpoint, each server with its
defaults: streaming completions, P-token prompts (token ids, so both servers see exactly P
tokens), N output tokens with `ignore_eos`, at concurrency 8 and 32. Not a test: prints a
table (and --json writes it).

    .venv/bin/python bench/bench_vs_vllm.py --quick            # ~2 min on a quiet 2-core box
    .venv/bin/python bench/bench_vs_vllm.py --vllm /work/wt/_vllm-venv/bin/vllm \
        --requests 4 --rounds 2                                 # issue 26's cells, A B A B

The checkpoint is `applianced model init-tiny --preset 82m` (random Llama, hidden 768,
12 layers, 81.8M parameters, fp32 on disk) unless --model names one; `--shape qwen3`
serves the same weights as a Qwen3 (`make_qwen3_model`: q/k norms added), `--shape
qwen3-moe` a Qwen3-MoE of the same width with Qwen3-30B-A3B's expert layout
(`make_qwen3_moe_model`: 0.93B parameters, 80M active, bf16 on disk). vLLM runs from its
own venv (`--vllm`, the `vllm` script there; skipped when absent); both servers are up
at once and are measured ALTERNATELY (A B A B ...: `--rounds`), so load from other jobs
on the machine falls on both alike; the table gives each cell's median over the rounds.
The first cell starts once applianced's workers have faulted in their KV pools
(`kv_populated`, which they do at idle priority after start), as vLLM's start touches its
pool before it answers `/health`.

Per cell, the client (aiohttp, this process) keeps C requests in flight until C ×
`--requests` have finished, after two warm-up requests:
  req/s   finished requests / wall time from the first send to the last byte;
  TTFT    time from send to the first streamed token, p50 over requests;
  ITL     (last token time - first token time) / (tokens - 1) per request, p50 — what
          aiperf calls inter-token latency;
  CPU s/request  CPU time of the server's process tree during the cell / requests (warm-up
          included): the cost of a request whatever share of the cores other jobs leave.
  reference loop  ms of a fixed Python loop just before the cell (`reference_ms`): the
          host's clock then; rows far apart in it are not comparable (a compute-bound
          server slows with the clock more than a memory-bound one).
NVIDIA's aiperf is the reference client: `--aiperf PATH` also runs it against each
server in each round, right after this client's cell (so A B A B for it too), and prints
its req/s and p50s (medians over rounds), the server's CPU s/request under it, the
cores aiperf itself took, and vLLM's prefix-cache hits (each request a prompt of its own, so
none is expected). In its default concurrency mode aiperf's timing manager waits for
a free slot by yielding to its event loop in a loop: ~0.45 of a core, out of the server's
on a 2-core box. `--aiperf-args '--request-rate 100'` paces it instead (the concurrency
cap unchanged, a free slot refilled within 10 ms): ~0.15 cores. `--ledger` also reads
each applianced server's own ledger for each client's run (`ledger_view`): where two
clients' rates differ, whether they sent different work, kept fewer requests in flight,
or the same requests took longer in the daemon.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_process import ROOT, free_port, pct, start_daemon, wait_populated, wait_ready  # noqa: E402


def make_model(cache: Path) -> Path:
    target = cache / "bench-82m"
    if not (target / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "appliance", "model", "init-tiny", str(target),
                        "--preset", "82m", "--seed", "1"], check=True, cwd=ROOT)
    return target


def _beside(base: Path, name: str) -> tuple[Path, dict | None]:
    """A checkpoint derived from `base`, in a folder `name` beside it: the folder, and
    base's config to edit (None where the folder already holds its weights); every file
    but the config and the weights (the tokenizer's) copied over."""
    target = base.parent / name
    if (target / "model.safetensors").exists():
        return target, None
    target.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, target / f.name)
    return target, json.loads((base / "config.json").read_text())


def make_qwen3_model(base: Path) -> Path:
    """The Qwen3-shaped cell's checkpoint: the 82m Llama's weights and tokenizer under a
    Qwen3 config (Qwen3ForCausalLM: per-head RMSNorm on q and k, head_dim 64, rope theta
    1e6, no attention bias), with seeded random q/k norm weights (1 + 0.1 N(0, 1)): the
    same 81.8M parameters (+1.5k), so the cells compare the families' step costs."""
    target, config = _beside(base, "bench-82m-qwen3")
    if config is None:
        return target
    import torch
    from safetensors.torch import load_file, save_file
    head_dim = config["head_dim"]
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1e6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=config["num_hidden_layers"])
    for key in ("mlp_bias", "pretraining_tp"):
        config.pop(key, None)
    weights = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for i in range(config["num_hidden_layers"]):
        for name in ("q_norm", "k_norm"):
            weights[f"model.layers.{i}.self_attn.{name}.weight"] = (
                1.0 + 0.1 * torch.randn(head_dim, generator=g)).to(torch.float32)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def make_qwen3_moe_model(base: Path) -> Path:
    """The MoE cell's checkpoint: Qwen3-30B-A3B's expert layout (128 experts, top 8,
    renormalized; experts a third of the hidden size wide) at the 82m shape's width and
    depth (hidden 768, 12 layers, 12 heads, 4 KV heads, head_dim 64, experts of 256): 0.93B
    parameters, 80M active a token, so a token's weights are the 82m model's but a decode
    step at B sequences reads up to 8 B experts a layer. bf16 on disk, as Qwen3's are;
    seeded random weights (N(0, 0.02), norms 1 + 0.1 N(0, 1)) and the 82m's tokenizer."""
    target, config = _beside(base, "bench-a3b-qwen3-moe")
    if config is None:
        return target
    import torch
    from safetensors.torch import save_file
    for key in ("mlp_bias", "pretraining_tp", "intermediate_size"):
        config.pop(key, None)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=config["num_hidden_layers"],
                  intermediate_size=2048, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001,
                  torch_dtype="bfloat16", dtype="bfloat16")
    D, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    H, KVH, hd, E, I = (config["num_attention_heads"], config["num_key_value_heads"],
                        config["head_dim"], 128, 256)
    g = torch.Generator().manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(*shape, generator=g)).bfloat16()

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).bfloat16()
    weights = {"model.embed_tokens.weight": w(V, D), "lm_head.weight": w(V, D),
               "model.norm.weight": norm(D)}
    for i in range(L):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": norm(D),
                        p + "post_attention_layernorm.weight": norm(D),
                        p + "self_attn.q_proj.weight": w(H * hd, D),
                        p + "self_attn.k_proj.weight": w(KVH * hd, D),
                        p + "self_attn.v_proj.weight": w(KVH * hd, D),
                        p + "self_attn.o_proj.weight": w(D, H * hd),
                        p + "self_attn.q_norm.weight": norm(hd),
                        p + "self_attn.k_norm.weight": norm(hd),
                        p + "mlp.gate.weight": w(E, D)})
        for e in range(E):
            x = f"{p}mlp.experts.{e}."
            weights.update({x + "gate_proj.weight": w(I, D), x + "up_proj.weight": w(I, D),
                            x + "down_proj.weight": w(D, I)})
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def checkpoint(model: Path | None, shape: str) -> Path:
    """`--model`, else the 82m preset under the user's cache, as a Qwen3 for `--shape
    qwen3`; `--shape qwen3-moe`: a Qwen3-MoE of the same width (`make_qwen3_moe_model`)."""
    if model:
        return model
    base = make_model(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                      / "applianced-bench")
    if shape == "qwen3-moe":
        return make_qwen3_moe_model(base)
    return make_qwen3_model(base) if shape == "qwen3" else base


def start_vllm(vllm: str, model: Path, log: Path, timeout: float = 900,
               extra: tuple[str, ...] = ()):
    port = free_port()
    # Defaults but for memory: vLLM's CPU backend reserves 92% of RAM at start and refuses
    # to start where other jobs use more than 8%; 1 GiB of KV, as applianced's workers have.
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([vllm, "serve", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "--served-model-name", model.name,
                             "--gpu-memory-utilization", "0.5", *extra],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", log, path="/health",
                            timeout=timeout, interval=1, stop=stop)


class _Pid:
    """A server this process did not start (--vllm-pid): enough of a Popen for cpu_seconds."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int:
        return 0            # not ours to stop


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """CPU time (user + system) of a server's whole process tree so far: the daemon and
    its workers, or vLLM's API server and engine. Per request, it says what a request costs
    whatever share of the cores other jobs leave the server, which wall-clock rates on a
    loaded machine do not. Children that exited are not counted (none do mid-run)."""
    if proc is None:
        return float("nan")
    import psutil
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def one_request(session, url: str, body: dict) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed token)."""
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
    return t0, times


async def cell(url: str, model: str, concurrency: int, total: int, prompt_tokens: int,
               output_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)

    def body() -> dict:
        # Random ids above the special tokens: no prefix is shared between requests.
        return {"model": model, "prompt": [rng.randrange(16, vocab) for _ in range(prompt_tokens)],
                "max_tokens": output_tokens, "min_tokens": output_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}

    conn = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(one_request(session, url, body()) for _ in range(2)))  # warm-up
        results: list[tuple[float, list[float]]] = []
        left = total

        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                results.append(await one_request(session, url, body()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = [times[0] - t0 for t0, times in results if times]
    itl = [(times[-1] - times[0]) / (len(times) - 1) for _, times in results if len(times) > 1]
    tokens = sum(len(t) for _, t in results)
    return {"req_s": len(results) / wall, "ttft_p50_s": pct(ttft, 0.5),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "tokens": tokens, "requests": len(results),
            "wall_s": wall}


def reference_ms() -> float:
    """Milliseconds of a fixed pure-Python loop on this process's core, taken before each
    cell: a proxy for the host's clock at that moment. On the shared development VM the
    clock swung 1.3-2.7 GHz within a day, and a compute-bound server (vLLM's engine)
    slows with it more than a memory-bound one, so a ratio between servers is only read
    beside this (docs/benchmarks.md, session 20)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(300_000):
            x += i & 7
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def matmul_flops_per_row(shape) -> tuple[float, float]:
    """FLOPs of one row of a dense `LlamaShape` through its layers' projections and MLPs,
    and through its LM head."""
    d, q = shape.hidden_size, shape.q_size
    layer = 2 * (d * (q + 2 * shape.kv_size) + q * d + 3 * d * shape.intermediate_size)
    return shape.num_layers * layer, 2 * d * shape.vocab_size


def request_gflop(config: dict, prompt_tokens: int, output_tokens: int) -> float:
    """The matmul GFLOP one request of the cell asks of a dense checkpoint: every prompt row
    and every decoded row but the last through the layers, and the LM head once per output
    token. Why: both servers' figures are CPU-bound here, and this over CPU seconds a
    request says how far each runs from a core's peak (bench/bf16_peak.c) whatever the
    host's clock that day. Counts the work asked, not what an engine skips."""
    from appliance.models.shape import LlamaShape
    layers, head = matmul_flops_per_row(LlamaShape.from_hf_config(config))
    return ((prompt_tokens + output_tokens - 1) * layers + output_tokens * head) / 1e9


def prefix_hit_tokens(url: str) -> float | None:
    """vLLM's count of prompt tokens served from its prefix cache so far, from its
    /metrics; None where the server exports no such counter (applianced: its ledger's
    `cached_tokens` tells, `--ledger`). The difference over a client's run says whether
    that run's prompts shared prefixes the server reused."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    # by sample name: the parser does not always file a counter named with a colon under
    # its TYPE line's family (it gives each sample a family of its own)
    hits = [s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "vllm:prefix_cache_hits_total"]
    return sum(hits) if hits else None


def run_aiperf(aiperf: str, url: str, model: Path, concurrency: int, total: int,
               prompt_tokens: int, output_tokens: int, out: Path, extra: list[str] = (),
               server=None) -> dict | None:
    """aiperf's own numbers for one cell (None when it fails: its CLI moves between releases),
    with what it cost: the server's CPU s/request over the run, and the cores aiperf's own
    process tree took while the server was busy (sampled every 0.25 s), since on a small box
    the client's CPU comes out of the server's. Every request gets a prompt of its own, as
    from this module's client (`--num-dataset-entries` = the request count: aiperf 0.13
    already makes one per request, the flag keeps it so), so no two share a prefix."""
    cmd = [aiperf, "profile", "--model", model.name, "--tokenizer", str(model), "--url", url,
           "--endpoint-type", "completions", "--streaming", "--concurrency", str(concurrency),
           "--request-count", str(total), "--synthetic-input-tokens-mean", str(prompt_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", f"min_tokens:{output_tokens}", "--num-dataset-entries", str(total),
           "--artifact-dir", str(out), *extra]

    before, hits_before = cpu_seconds(server), prefix_hit_tokens(url)
    log = out.parent / f"{out.name}.log"
    samples = []                                    # (time, aiperf CPU s, server CPU s)
    with open(log, "wb") as sink:
        run = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        while run.poll() is None:
            samples.append((time.monotonic(), cpu_seconds(run), cpu_seconds(server)))
            time.sleep(0.25)
    server_cpu = cpu_seconds(server) - before
    hits_after = prefix_hit_tokens(url)
    found = list(out.rglob("profile_export_aiperf.json"))
    if run.returncode != 0 or not found:
        print(f"  aiperf failed ({run.returncode}): {log.read_text(errors='replace')[-500:]}")
        return None
    data = json.loads(found[0].read_text())
    get = lambda k, f: (data.get(k) or {}).get(f)  # noqa: E731
    counted = output_counts(found[0].with_name("profile_export.jsonl"))
    # the load: the samples between which the server took more than half a core
    busy = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(samples, samples[1:])
            if b[0] > a[0] and (b[2] - a[2]) / (b[0] - a[0]) > 0.5]
    wall = sum(w for w, _ in busy)
    return {"req_s": get("request_throughput", "avg"),
            "ttft_p50_s": (get("time_to_first_token", "p50") or 0) / 1e3,
            "itl_p50_ms": get("inter_token_latency", "p50"),
            "cpu_s_per_req": server_cpu / total if server is not None else float("nan"),
            "client_cores": sum(c for _, c in busy) / wall if wall else float("nan"),
            "prefix_hit_tokens": (hits_after - hits_before if None not in (hits_before,
                                  hits_after) else float("nan")),
            **counted}


def output_counts(records: Path) -> dict:
    """What aiperf's ITL divides by, from its per-request records. It counts a response's
    tokens by encoding the streamed text again with the tokenizer (unless
    `--use-server-token-count`), and a random model's text seldom encodes back to the
    tokens that made it: a server whose output encodes to more tokens gets a lower ITL for
    the same decode time. So beside aiperf's own p50 this gives the mean of its count, the
    server's count (the response's `usage`, which aiperf asks for), and the p50 over
    requests of decode time / (the server's count - 1), the ITL of the tokens decoded."""
    nan = float("nan")
    local, server, itl = [], [], []
    try:
        lines = records.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            metrics = json.loads(line).get("metrics") or {}
        except ValueError:
            continue
        # a metric is a number, or {"value": number, "unit": ...}
        m = {k: v.get("value") if isinstance(v, dict) else v for k, v in metrics.items()}
        n, decode = m.get("usage_completion_tokens"), m.get("decode_duration")
        if m.get("output_token_count") is not None:
            local.append(m["output_token_count"])
        if n:
            server.append(n)
            if decode is not None and n > 1:
                itl.append(decode / (n - 1))
    return {"tokens_counted": statistics.mean(local) if local else nan,
            "tokens_served": statistics.mean(server) if server else nan,
            "itl_p50_ms_served_tokens": statistics.median(itl) if itl else nan}


def ledger_file(state: Path, t0: float, t1: float, n: int, timeout: float = 40.0) -> Path:
    """The ledger under a daemon's state dir, once it holds the `n` requests that arrived
    in [t0, t1] (or after `timeout`): a request's row is committed when its accounting
    window closes, up to ~15 s after it finished (`[accounting] window_s` + grace)."""
    import sqlite3
    deadline = time.monotonic() + timeout
    while True:
        found = next(state.rglob("ledger.db"), None)
        if found is not None:
            with sqlite3.connect(f"file:{found}?mode=ro", uri=True, timeout=5) as con:
                have = con.execute("SELECT count(*) FROM requests WHERE arrival BETWEEN ? AND ?",
                                   (t0, t1)).fetchone()[0]
            if have >= n or time.monotonic() > deadline:
                return found
        elif time.monotonic() > deadline:
            raise SystemExit(f"--ledger: no ledger.db under {state}")
        time.sleep(0.5)


def ledger_view(db: Path, t0: float, t1: float, concurrency: int, skip: int = 0) -> dict:
    """What applianced's own ledger says of the requests that arrived in [t0, t1] (one
    client's run, its first `skip` warm-up requests left out): the tokens it served and
    how long each took inside the daemon. Two clients whose rates differ on the same
    server either sent different work (prompt, cached or output tokens), kept fewer
    requests in flight (slots: the requests' time in the daemon over C x the span), or
    made the same requests slower (duration)."""
    import sqlite3
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
        rs = con.execute("SELECT arrival, first_token, finish, prompt_tokens, cached_tokens, "
                         "output_tokens FROM requests WHERE arrival BETWEEN ? AND ? AND "
                         "status = 'ok' ORDER BY arrival", (t0, t1)).fetchall()[skip:]
    if not rs:
        return {}
    span = max(r[2] for r in rs) - min(r[0] for r in rs)
    took = [r[2] - r[0] for r in rs]
    return {"requests": len(rs), "req_s": len(rs) / span,
            "prompt_tokens": statistics.mean(r[3] for r in rs),
            "cached_tokens": statistics.mean(r[4] for r in rs),
            "output_tokens": statistics.mean(r[5] for r in rs),
            "duration_s": statistics.mean(took),
            "ttft_s": statistics.mean(r[1] - r[0] for r in rs if r[1] is not None),
            "slots_busy": sum(took) / (span * concurrency)}


def parse_variant(text: str) -> tuple[str, Path, dict[str, dict[str, str]]]:
    """'NAME[@ROOT]:section.key=VALUE,...' -> (name, source root, {section: {key: VALUE}});
    VALUE is a TOML literal (strings quoted)."""
    head, _, body = text.partition(":")
    name, _, root = head.partition("@")
    tables: dict[str, dict[str, str]] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        section, dot, leaf = key.strip().partition(".")
        if not (sep and dot and leaf):
            raise SystemExit(f"--variant {text!r}: {item!r} is not section.key=VALUE")
        tables.setdefault(section, {})[leaf] = value.strip()
    return name, Path(root).resolve() if root else ROOT, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: the 82m preset)")
    ap.add_argument("--shape", choices=("llama", "qwen3", "qwen3-moe"), default="llama",
                    help="without --model: the 82m Llama, the same weights as a Qwen3, or "
                         "a Qwen3-MoE of that width (128 experts, top 8: 0.93B, 80M active)")
    ap.add_argument("--vllm", default="/work/wt/_vllm-venv/bin/vllm",
                    help="vLLM's `vllm` script in its own venv ('' to skip)")
    ap.add_argument("--vllm-url", default="",
                    help="a vLLM already serving the same checkpoint (skips starting one)")
    ap.add_argument("--vllm-args", default="",
                    help="extra `vllm serve` flags, e.g. '--dtype float32' (its best on a CPU "
                         "without AVX512-BF16, where its default bf16 is emulated)")
    ap.add_argument("--vllm-pid", type=int, default=0,
                    help="with --vllm-url: its `vllm serve` process, for CPU s/request")
    ap.add_argument("--aiperf", default="",
                    help="aiperf's script: each round also runs it against each server, "
                         "after this client's cell")
    ap.add_argument("--aiperf-args", default="",
                    help="extra aiperf flags, e.g. '--request-rate 100' (paced: the same "
                         "concurrency cap, without aiperf's busy wait for a free slot)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--requests", type=int, default=3, help="requests per cell = C × this")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds per cell (median)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--applianced-args", default="", help="extra `applianced serve` flags")
    ap.add_argument("--dtypes", default="auto",
                    help="applianced's `[engine] dtype`, one server each (e.g. auto,bfloat16)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME[@ROOT]:KEY=VAL,...",
                    help="one more applianced server, configured by dotted TOML keys (e.g. "
                         "'agg:devices.mode=\"agg\"'); @ROOT runs another checkout's source "
                         "(the same client against two versions of the engine)")
    ap.add_argument("--quick", action="store_true", help="c=8 only, 2 requests each, 1 round")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ledger", action="store_true",
                    help="also read each applianced server's ledger for each client's run: "
                         "tokens served, time in the daemon, how full the C slots were")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.rounds = "8", 2, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    model = checkpoint(args.model, args.shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        names = {"vLLM CPU": model.name}
        configs = [("applianced" if d == "auto" else f"applianced {d}", ROOT,
                    {"engine": {"dtype": f'"{d}"'}}) for d in args.dtypes.split(",") if d]
        configs += [parse_variant(v) for v in args.variant]
        for i, (name, root, tables) in enumerate(configs):
            state = tmp / f"state-{i}"
            state.mkdir()
            (state / "config.toml").write_text("".join(
                f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                for section, keys in tables.items()))
            servers[name] = start_daemon(state, ["--model", str(model), "--engine", "torch",
                                                 "--config", str(state / "config.toml"),
                                                 *args.applianced_args.split()], root=root)
            names[name] = model.name
        if args.vllm_url:
            servers["vLLM CPU"] = (_Pid(args.vllm_pid) if args.vllm_pid else None,
                                   args.vllm_url.rstrip("/"))
        elif args.vllm and Path(args.vllm).exists():
            servers["vLLM CPU"] = start_vllm(args.vllm, model, tmp / "vllm.log",
                                             extra=tuple(shlex.split(args.vllm_args)))
        else:
            print(f"vLLM not found at {args.vllm!r}: measuring applianced alone")
        for name, _, _ in configs:  # (vLLM's pool is touched in its start, before /health)
            waited = wait_populated(servers[name][1])
            print(f"{name}: KV pools faulted in ({waited:.1f} s more after the servers' starts)")
        ledgers = {name: tmp / f"state-{i}" for i, (name, _, _) in enumerate(configs)
                   if args.ledger}
        rows = []
        for c in levels:
            samples: dict[str, list[dict]] = {n: [] for n in servers}
            by_aiperf: dict[str, list[dict]] = {n: [] for n in servers}
            # --ledger: each client's runs per server, (t0, t1, warm-up requests, requests)
            runs: dict[str, dict[str, list[tuple]]] = {
                n: {"this client": [], "aiperf": []} for n in ledgers}
            for r in range(args.rounds):
                for name, (proc, url) in servers.items():       # A B A B
                    ref = reference_ms()
                    before = cpu_seconds(proc)
                    t0 = time.time()
                    s = asyncio.run(cell(url, names[name], c, c * args.requests,
                                         args.prompt_tokens, args.output_tokens, vocab,
                                         seed=1000 * r + c))
                    # warm-up requests included: (C x requests + 2) per cell
                    s["cpu_s_per_req"] = ((cpu_seconds(proc) - before) / (s["requests"] + 2)
                                          if proc is not None else float("nan"))
                    s["reference_ms"] = ref
                    print(f"  c={c} round {r + 1} {name}: {s['req_s']:.2f} req/s, TTFT p50 "
                          f"{s['ttft_p50_s']:.2f} s, ITL p50 {s['itl_p50_ms']:.1f} ms, "
                          f"{s['cpu_s_per_req']:.2f} CPU s/request (reference loop "
                          f"{ref:.1f} ms)", flush=True)
                    samples[name].append(s)
                    if name in runs:
                        runs[name]["this client"].append((t0, time.time(), 2, s["requests"] + 2))
                    if args.aiperf:
                        t0 = time.time()
                        a = run_aiperf(args.aiperf, url, model, c, c * args.requests,
                                       args.prompt_tokens, args.output_tokens,
                                       tmp / f"aiperf-{len(rows)}-{r}-{name.replace(' ', '_')}",
                                       shlex.split(args.aiperf_args), proc)
                        if a:
                            print(f"  c={c} round {r + 1} {name} by aiperf: {a['req_s']:.2f} "
                                  f"req/s, TTFT p50 {a['ttft_p50_s']:.2f} s, ITL p50 "
                                  f"{a['itl_p50_ms']:.1f} ms, {a['cpu_s_per_req']:.2f} CPU "
                                  f"s/request, aiperf took {a['client_cores']:.2f} cores",
                                  flush=True)
                            by_aiperf[name].append(a)
                            if name in runs:
                                runs[name]["aiperf"].append((t0, time.time(), 0,
                                                             c * args.requests))
            for name, ss in samples.items():
                row = {"concurrency": c, "server": name, "rounds": len(ss),
                       **({"vllm_args": args.vllm_args}
                          if name == "vLLM CPU" and args.vllm_args else {}),
                       **{k: statistics.median(s[k] for s in ss)
                          for k in ("req_s", "ttft_p50_s", "itl_p50_ms", "cpu_s_per_req",
                                    "reference_ms")}}
                if by_aiperf[name]:
                    row["aiperf"] = {"args": args.aiperf_args, "rounds": len(by_aiperf[name]),
                                     **{k: statistics.median(a[k] for a in by_aiperf[name])
                                        for k in ("req_s", "ttft_p50_s", "itl_p50_ms",
                                                  "cpu_s_per_req", "client_cores",
                                                  "prefix_hit_tokens", "tokens_counted",
                                                  "tokens_served",
                                                  "itl_p50_ms_served_tokens")}}
                if name in runs:
                    row["ledger"] = {}
                    for client, windows in runs[name].items():
                        views = [ledger_view(ledger_file(ledgers[name], t0, t1, n), t0, t1, c,
                                             skip) for t0, t1, skip, n in windows]
                        views = [v for v in views if v]
                        if views:
                            row["ledger"][client] = {k: statistics.median(v[k] for v in views)
                                                     for k in views[0]}
                rows.append(row)
        print(f"\n{model.name}: {args.prompt_tokens}-token prompts, {args.output_tokens} output "
              f"tokens, medians of {args.rounds} alternating round(s)")
        print("| concurrency | server | req/s | TTFT p50 | ITL p50 | CPU s/request | reference "
              "loop |\n|---|---|---:|---:|---:|---:|---:|")
        for row in rows:
            print(f"| {row['concurrency']} | {row['server']} | {row['req_s']:.2f} | "
                  f"{row['ttft_p50_s']:.2f} s | {row['itl_p50_ms']:.1f} ms | "
                  f"{row['cpu_s_per_req']:.2f} | {row['reference_ms']:.1f} ms |")
        gflop = request_gflop(json.loads((model / "config.json").read_text()),
                              args.prompt_tokens, args.output_tokens)

        def per_cpu_s(cpu_s: float) -> float:
            return gflop / cpu_s if cpu_s > 0 else float("nan")    # nan: no CPU reading

        print(f"\nmatmul work a request, counted from config.json: {gflop:.1f} GFLOP; "
              "GFLOPS per CPU second (this client, then aiperf):")
        for row in rows:
            by_aiperf = (f", {per_cpu_s(row['aiperf']['cpu_s_per_req']):.0f}"
                         if row.get("aiperf") else "")
            print(f"  c={row['concurrency']} {row['server']}: "
                  f"{per_cpu_s(row['cpu_s_per_req']):.0f}{by_aiperf}")
        if any(row.get("aiperf") for row in rows):
            print(f"\nby aiperf ({args.aiperf_args or 'its defaults'}), medians of its rounds")
            print("| concurrency | server | req/s | TTFT p50 | ITL p50 | output tokens: aiperf's "
                  "count / the server's | ITL p50 over the server's tokens | CPU s/request | "
                  "aiperf's cores | prefix-cache hits (tokens) |\n"
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for row in rows:
                if a := row.get("aiperf"):
                    hits = a.get("prefix_hit_tokens", float("nan"))
                    print(f"| {row['concurrency']} | {row['server']} | {a['req_s']:.2f} | "
                          f"{a['ttft_p50_s']:.2f} s | {a['itl_p50_ms']:.1f} ms | "
                          f"{a.get('tokens_counted', float('nan')):.1f} / "
                          f"{a.get('tokens_served', float('nan')):.1f} | "
                          f"{a.get('itl_p50_ms_served_tokens', float('nan')):.1f} ms | "
                          f"{a['cpu_s_per_req']:.2f} | {a['client_cores']:.2f} | "
                          f"{'-' if hits != hits else f'{hits:.0f}'} |")
        if any(row.get("ledger") for row in rows):
            print("\nin applianced's ledger (medians of the rounds): req/s over the requests' own "
                  "span, tokens a request, mean time in the daemon and to the first token, "
                  "slots busy = time in the daemon / (C x span)")
            print("| concurrency | server | client | req/s | prompt | cached | output | in the "
                  "daemon | TTFT | slots busy |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
            for row in rows:
                for client, v in (row.get("ledger") or {}).items():
                    print(f"| {row['concurrency']} | {row['server']} | {client} | "
                          f"{v['req_s']:.2f} | {v['prompt_tokens']:.0f} | {v['cached_tokens']:.0f}"
                          f" | {v['output_tokens']:.0f} | {v['duration_s']:.3f} s | "
                          f"{v['ttft_s']:.3f} s | {v['slots_busy']:.0%} |")
        by = {(r["concurrency"], r["server"]): r for r in rows}
        for c in levels:
            v = by.get((c, "vLLM CPU"))
            for name in servers:
                a = by.get((c, name))
                if a and v and a is not v:
                    print(f"c={c} {name}: req/s ×{a['req_s'] / v['req_s']:.2f} of vLLM's, "
                          f"ITL ×{v['itl_p50_ms'] / a['itl_p50_ms']:.2f} (vLLM's / ours)")
                    if a.get("aiperf") and v.get("aiperf"):
                        aa, va = a["aiperf"], v["aiperf"]
                        print(f"c={c} {name} by aiperf: req/s ×{aa['req_s'] / va['req_s']:.2f} "
                              f"of vLLM's, ITL ×{va['itl_p50_ms'] / aa['itl_p50_ms']:.2f}; "
                              f"aiperf took {aa['client_cores']:.2f} / {va['client_cores']:.2f} "
                              "cores; ITL over the servers' own token counts "
                              f"×{va['itl_p50_ms_served_tokens'] / aa['itl_p50_ms_served_tokens']:.2f}")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    finally:
        for proc, _ in servers.values():
            if proc is not None:
                stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
