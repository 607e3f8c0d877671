"""What a riding prompt's rows cost a CPU decode worker's step (`engine.cpu_decode_ride_rows`).

Builds the engine the way the daemon builds a decode worker (`build_torch_engine` with the
host's C kernels and the auto ride rows), in-process, one torch thread: N sequences of a
P-token prompt decode, then a prompt marked to ride (as the router marks one,
`Sequence.ride`) joins them and goes along in chunks of the rows left. Alternates a bare
decode step with a riding one on two engines built alike, pair by pair, so a slow stretch
of the machine falls on both; CPU time (`time.process_time`), medians.

Why: a riding row is the step's price for a prompt token that the prefill worker would
otherwise compute in a whole prompt's step; the difference between the two steps over the
riding rows is what each of those tokens costs here, and what every decoding sequence's
inter-token latency pays for it.

    taskset -c 1 .venv/bin/python bench/bench_ride_step.py            # Llama shape, 3 decoding
    taskset -c 1 .venv/bin/python bench/bench_ride_step.py --qwen3 --decoding 2,3,5
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from appliance.engines.messages import Prefill, SamplingParams  # noqa: E402
from appliance.engines.torch_engine import build_torch_engine  # noqa: E402
from appliance.worker.spec import WorkerSpec  # noqa: E402
import bench_vs_vllm  # noqa: E402


def engine(model_dir: Path, decoding: int, prompt: int, seed: int):
    spec = WorkerSpec(worker="decode0", role="decode", engine="torch", devices=["cpu0"],
                      device_kind="cpu", model_dir=str(model_dir), cpu_kernels="auto",
                      cpu_decode_ride_rows=-1, kv_cache_bytes=1 << 29)
    eng = build_torch_engine(spec, model_dir)
    if not eng.ride_rows:
        raise SystemExit(f"no riding on this host ({model_dir.name}): the decode worker's "
                         "steps are not one C call here (engine.cpu_decode_ride_rows)")
    rng = random.Random(seed)
    vocab = eng.model.shape.vocab_size
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)

    def ids() -> list[int]:
        return [0] + [rng.randrange(5, vocab) for _ in range(prompt - 1)]
    for i in range(decoding):
        eng.add(Prefill(f"d{i}", ids(), params, handoff=False))
    while eng.scheduler.waiting or eng.scheduler.prefilling:
        eng.step()
    return eng, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen3", action="store_true", help="the Qwen3-shaped 82m checkpoint")
    ap.add_argument("--decoding", default="3", help="sequences decoding, e.g. 2,3,5")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (each context)")
    ap.add_argument("--pairs", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cache = Path.home() / ".cache" / "applianced-bench"
    base = bench_vs_vllm.make_model(cache)
    model_dir = bench_vs_vllm.make_qwen3_model(base) if args.qwen3 else base
    for n in [int(x) for x in args.decoding.split(",")]:
        bare, _ = engine(model_dir, n, args.prompt, 1)
        layer_flops, _ = bench_vs_vllm.matmul_flops_per_row(bare.model.shape)
        ride, ids = engine(model_dir, n, args.prompt, 2)
        rows = ride.ride_rows - n
        if rows < 1:
            print(f"{n} decoding: no room to ride ({ride.ride_rows} rows a step)")
            continue
        ride.add(Prefill("rider", ids(), SamplingParams(max_tokens=1, temperature=0.0),
                         handoff=False))
        ride.scheduler.waiting[-1].ride = True
        for eng in (bare, ride):            # warm-up (the rider's first chunk included)
            eng.step()
        t_bare, t_ride = [], []
        for _ in range(args.pairs):
            for eng, out in ((bare, t_bare), (ride, t_ride)):
                c0 = time.process_time()
                eng.step()
                out.append((time.process_time() - c0) * 1e3)
            if not ride.scheduler.prefilling:
                raise SystemExit(f"the prompt did not ride ({n} decoding, its KV admitted: "
                                 f"{not ride.scheduler.waiting})")
        b, r = statistics.median(t_bare), statistics.median(t_ride)
        per_row = (r - b) / rows
        whole = layer_flops / 1e6 / 77.0     # ms a prompt token at the GEMM's ~77 GFLOPS
        print(f"{model_dir.name} {n} decoding, {rows} riding rows: bare step {b:.1f} ms, "
              f"with the rider {r:.1f} ms (CPU, medians of {len(t_bare)} pairs): "
              f"{per_row:.2f} ms a riding token against ~{whole:.2f} ms in a whole prompt "
              f"at 77 GFLOPS", flush=True)


if __name__ == "__main__":
    main()
