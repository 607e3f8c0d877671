"""The prefill -> decode KV handoff, per request: within a box (/dev/shm: the decode
worker maps the prefill worker's pool and copies the blocks) against across boxes (NIXL:
the decode worker READs them through UCX), both between two real processes on this
host. NIXL runs twice: with UCX's own choice of transport (on one host: shared memory /
CMA) and with UCX_TLS=tcp, the path two boxes without RDMA take (here over loopback, so
no NIC limits it: an upper bound for TCP, not a network measurement).

Prompts of 1k, 8k and 32k tokens on the generated small model's KV shape (the `tiny`
preset: 4 layers, 2 KV heads, head_dim 64, fp32, 16-token blocks = 64 KiB a block), and
a 70B-shaped block (Llama-3-70B: 80 layers, 8 KV heads, head_dim 128, bf16 = 5 MiB a
block) at 1k tokens (--big-tokens for more: 8k is 2.5 GiB per pool). Block ids are
contiguous ("run": a fresh allocator) or shuffled on both sides ("scattered": one
descriptor per block and K/V layer row, the worst case). Each cell is the median of
--reps requests after one warm-up read (the first read from a peer maps its memory: its
cost is printed once). Every transfer is checked byte-exact. The control-channel hop
that carries the handle is not included (it is the same for both). 75 s on this
2-core machine when quiet, ~6 min at load average 18.

    .venv/bin/python bench/bench_kv_transfer.py   # -> bench/results/kv_transfer.json; needs nixl-cu12
    .venv/bin/python bench/bench_kv_transfer.py --big-tokens 1024 8192 --reps 9   # ~5 GiB of shm
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    # name: (layers, kv_heads, head_dim, dtype)
    "tiny": (4, 2, 64, "float32"),
    "70b": (80, 8, 128, "bfloat16"),
}
BLOCK = 16


def _pool_shape(shape: str, blocks: int) -> tuple[int, ...]:
    layers, heads, dim, _ = SHAPES[shape]
    return (2, layers, blocks, BLOCK, heads, dim)


def prefill(shape: str, blocks: int) -> None:
    """The prefill worker: one shm pool, exported for /dev/shm and registered with NIXL."""
    import torch

    from appliance.kv.handoff import allocate_pool, export_pool
    from appliance.kv.nixl_transport import NixlKvAgent, to_json

    torch.set_num_threads(1)
    dtype = getattr(torch, SHAPES[shape][3])
    pool = allocate_pool(_pool_shape(shape, blocks), dtype)
    # Every page touched; one random chunk repeated, its length no multiple of a block's,
    # so no two blocks hold the same bytes at the same place (a misplaced block shows).
    view = pool.view(-1)
    chunk = torch.randn((1 << 22) + 7, generator=torch.Generator().manual_seed(7)).to(dtype)
    for i in range(0, view.numel(), chunk.numel()):
        n = min(chunk.numel(), view.numel() - i)
        view[i:i + n] = chunk[:n]
    agent = NixlKvAgent(pool, name="bench-prefill")
    print(json.dumps({"shm": export_pool(pool).hex(), "nixl": to_json(agent.info())}), flush=True)
    sys.stdin.read()                                   # until the decode side is done
    agent.close()


def decode(shape: str, blocks: int, tokens: list[int], reps: int, with_shm: bool) -> None:
    """The decode worker: times each handoff into its own pool, checks the bytes."""
    import torch

    from appliance.kv.blocks import copy_blocks
    from appliance.kv.handoff import allocate_pool, import_pool
    from appliance.kv.nixl_transport import NixlKvAgent, NixlKvHandle, NixlPoolInfo, from_json

    torch.set_num_threads(1)
    peer_line = json.loads(sys.stdin.readline())
    dtype = getattr(torch, SHAPES[shape][3])
    own = allocate_pool(_pool_shape(shape, blocks), dtype)
    own.fill_(0)
    peer = import_pool(bytes.fromhex(peer_line["shm"])).tensor
    agent = NixlKvAgent(own, name="bench-decode")
    info = from_json(NixlPoolInfo, peer_line["nixl"])
    t0 = time.perf_counter()
    agent.connect(info)
    connect_s = time.perf_counter() - t0

    def handle(ids: list[int]) -> NixlKvHandle:
        return NixlKvHandle(agent=info.agent, pool_id=info.pool_id, request_id="bench",
                            block_ids=tuple(ids), num_tokens=len(ids) * BLOCK,
                            expires_at=time.time() + 60)

    t0 = time.perf_counter()
    agent.pull(handle([0]), [0])
    first_s = time.perf_counter() - t0
    rng = random.Random(3)
    rows = []
    for n_tok in tokens:
        n = n_tok // BLOCK
        for layout in ("run", "scattered"):
            if layout == "run":
                src, dst = list(range(n)), list(range(blocks - n, blocks))
            else:
                src, dst = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
            nbytes = own[:, :, :n].numel() * own.element_size()
            cells = {"tokens": n_tok, "layout": layout, "mib": nbytes / 2**20}
            for name in (("shm", "nixl") if with_shm else ("nixl",)):
                times = []
                for _ in range(reps + 1):
                    own[:, :, dst] = 0
                    t0 = time.perf_counter()
                    if name == "shm":
                        copy_blocks(peer, src, own, dst)
                    else:
                        agent.pull(handle(src), dst)
                    times.append(time.perf_counter() - t0)
                    if not torch.equal(own[:, :, dst], peer[:, :, src]):
                        raise SystemExit(f"{name}: blocks differ after the transfer")
                ms = statistics.median(times[1:]) * 1e3
                cells[name] = {"ms": ms, "mb_s": nbytes / 1e6 / (ms / 1e3)}
            rows.append(cells)
    print(json.dumps({"connect_ms": connect_s * 1e3, "first_read_ms": first_s * 1e3,
                      "rows": rows}), flush=True)
    agent.close()


def run_pair(shape: str, tokens: list[int], reps: int, ucx_tls: str | None,
             with_shm: bool) -> dict:
    blocks = max(tokens) // BLOCK * 2 if shape == "tiny" else max(tokens) // BLOCK
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    me = [sys.executable, __file__]
    pre = subprocess.Popen(me + ["--role", "prefill", "--shape", shape, "--blocks", str(blocks)],
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    dec = subprocess.Popen(me + ["--role", "decode", "--shape", shape, "--blocks", str(blocks),
                                 "--reps", str(reps), "--tokens", *map(str, tokens)]
                           + (["--with-shm"] if with_shm else []),
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dec.stdin.write(pre.stdout.readline())
        dec.stdin.flush()
        out = dec.stdout.readline()
        if not out:
            raise SystemExit(f"decode side failed (rc {dec.wait()})")
        return json.loads(out)
    finally:
        for p in (pre, dec):
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"))
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--big-tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--with-shm", action="store_true")
    a = ap.parse_args()
    if a.role == "prefill":
        return prefill(a.shape, a.blocks)
    if a.role == "decode":
        return decode(a.shape, a.blocks, a.tokens, a.reps, a.with_shm)

    sys.path.insert(0, str(ROOT))
    from appliance.kv.nixl_transport import nixl_available, INSTALL_HINT
    if not nixl_available():
        raise SystemExit(INSTALL_HINT)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"median of {a.reps} requests; MB/s = 10^6 bytes/s")
    print("| KV shape | prompt | blocks | MiB | /dev/shm copy | NIXL, UCX default (shm/CMA) "
          "| NIXL, UCX_TLS=tcp (loopback) |")
    print("|---|---|---|---|---|---|---|")
    notes = []
    raw = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": a.reps,
           "load_average": os.getloadavg(), "runs": {}}
    for shape, tokens in (("tiny", a.tokens), ("70b", a.big_tokens)):
        auto = run_pair(shape, tokens, a.reps, None, with_shm=True)
        tcp = run_pair(shape, tokens, a.reps, "tcp", with_shm=False)
        raw["runs"][shape] = {"ucx_default": auto, "ucx_tcp": tcp}
        for r, t in zip(auto["rows"], tcp["rows"]):
            def cell(c: dict) -> str:
                return f"{c['ms']:.2f} ms, {c['mb_s']:,.0f} MB/s"
            label = "tiny (64 KiB/block)" if shape == "tiny" else "70B (5 MiB/block)"
            print(f"| {label} | {r['tokens'] // 1024}k, {r['layout']} | "
                  f"{r['tokens'] // BLOCK} | {r['mib']:.0f} | {cell(r['shm'])} | "
                  f"{cell(r['nixl'])} | {cell(t['nixl'])} |")
        notes.append(f"{shape}: connect {auto['connect_ms']:.0f} ms / {tcp['connect_ms']:.0f} ms "
                     f"(tcp), first read {auto['first_read_ms']:.0f} ms / "
                     f"{tcp['first_read_ms']:.0f} ms (tcp)")
    print("\n" + "; ".join(notes))
    out = ROOT / "bench" / "results" / "kv_transfer.json"
    out.write_text(json.dumps(raw, indent=1))
    print(f"load average {os.getloadavg()[0]:.1f}; raw numbers in {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
