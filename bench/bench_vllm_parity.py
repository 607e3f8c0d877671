"""Greedy tokens: applianced against vLLM's CPU build on one checkpoint, token for token.

Both servers load the same directory in the same dtype (`--dtype`, default float32), and
each answers the same prompts (random token ids of several lengths, so no chat template
or tokenizer round trip stands between them) with `temperature = 0`, `ignore_eos` and
`logprobs = 2`. Per prompt the script reports whether the token ids are equal
(both servers name them "token_id:N" with vLLM's `return_tokens_as_token_ids`), and where
they are not, the first position that differs with both servers' top-2 log-probabilities
there: a divergence where one server's top two are within a rounding error of each other
is a near-tie that the two engines' different matmul orders resolve differently, not a
wrong model. Not a test (vLLM is not installed in CI): a measurement, run by hand.

    .venv/bin/python bench/bench_vllm_parity.py --shape qwen3            # the Qwen3 shape
    .venv/bin/python bench/bench_vllm_parity.py --model DIR --prompts 16 --dtype bfloat16

vLLM runs from its own venv (`--vllm`), as in bench/bench_vs_vllm.py; it compiles its
model at start (2-5 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vllm import checkpoint, start_vllm, stop  # noqa: E402
from daemon_process import start_daemon  # noqa: E402


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = choice["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "top": lp.get("top_logprobs") or [], "text": choice["text"]}


def top2_gap(top: dict | None) -> float:
    """How far apart a position's two likeliest tokens are (inf when not reported)."""
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: the 82m preset)")
    ap.add_argument("--shape", choices=("llama", "qwen3"), default="llama")
    ap.add_argument("--vllm", default="/work/wt/_vllm-venv/bin/vllm")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-parity-"))
    model = checkpoint(args.model, args.shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    prompts = [[rng.randrange(16, vocab) for _ in range(n)]
               for n in ([5, 17, 64, 129, 256, 300, 511, 700] * args.prompts)[:args.prompts]]
    state = tmp / "state"
    state.mkdir()
    (state / "config.toml").write_text(f'[engine]\ndtype = "{args.dtype}"\n')
    ours = start_daemon(state, ["--model", str(model), "--engine", "torch",
                                "--config", str(state / "config.toml")])
    theirs = start_vllm(args.vllm, model, tmp / "vllm.log", extra=("--dtype", args.dtype))
    rows = []
    try:
        for i, p in enumerate(prompts):
            a = complete(ours[1], model.name, p, args.max_tokens)
            b = complete(theirs[1], model.name, p, args.max_tokens)
            first = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                         None)
            row = {"prompt_tokens": len(p), "equal": a["tokens"] == b["tokens"],
                   "first_difference": first}
            if first is not None:
                row["applianced_top2"] = a["top"][first] if first < len(a["top"]) else None
                row["vllm_top2"] = b["top"][first] if first < len(b["top"]) else None
            lps = [abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])
                   if x is not None and y is not None]
            row["max_abs_logprob_diff"] = max(lps[:first] if first else lps, default=0.0)
            rows.append(row)
            print(f"prompt {i} ({len(p)} tokens): "
                  + ("equal" if row["equal"] else f"differs at token {first}: ours "
                     f"{row.get('applianced_top2')} vLLM {row.get('vllm_top2')}")
                  + f", max |logprob diff| before it {row['max_abs_logprob_diff']:.2e}", flush=True)
    finally:
        stop(ours[0])
        stop(theirs[0])
    equal = sum(r["equal"] for r in rows)
    print(f"\n{model.name} ({args.dtype}): {equal}/{len(rows)} prompts equal token for token "
          f"over {args.max_tokens} greedy tokens")
    gaps = [min(top2_gap(r["applianced_top2"]), top2_gap(r["vllm_top2"]))
            for r in rows if not r["equal"]]
    if gaps:
        print(f"where they part, the closer server's two likeliest tokens were at most "
              f"{max(gaps):.2e} apart in log-probability (a near-tie)")
    if args.json:
        args.json.write_text(json.dumps({"model": model.name, "dtype": args.dtype,
                                         "max_tokens": args.max_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
