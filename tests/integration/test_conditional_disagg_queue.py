"""Conditional disaggregation by queue length (`engine.conditional_disagg_queue_tokens`,
on by default for torch on the CPU): while prompts wait for the prefill worker, the
decode worker prefills one itself. Both paths must give the same greedy answer as
`transformers`, and the request records must say where each prompt ran."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from helpers.daemons import http, start_daemon

PROMPTS = ["def main(", "import os\n", "x = [", "Hello", "class Parser:\n    def __init__(self"]


def _records(d) -> list[dict]:
    return [json.loads(line) for line in d.log_text().splitlines()
            if line.startswith('{"request_id"')]


def test_prompts_prefilled_on_the_decode_worker_answer_as_handed_off_ones(tiny_model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import openai

    from appliance.daemon.tokenizer import ServedTokenizer
    tok = ServedTokenizer(tiny_model)
    ids = [tok.encode(p) for p in PROMPTS]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = {tuple(p): ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                       pad_token_id=1)[0, len(p):].tolist() for p in ids}

    # 1 token: every request that finds the decode worker without a prompt of its own
    # goes there; those that arrive while it has one go to the prefill worker
    d = start_daemon(tmp_path, tiny_model, "--devices", "cpu", "--engine", "torch",
                     "--mode", "disagg", "--log-requests",
                     config='[engine]\ndtype = "float32"\nconditional_disagg_queue_tokens = 1\n')
    try:
        status = d.status()
        model = status["model"]
        assert status["conditional_disagg"] == {"prompt_tokens": 0, "queue_tokens": 1,
                                                "prefill_share": 0.5}

        async def burst() -> list[tuple[list[int], str]]:
            client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused",
                                        max_retries=0, timeout=60)
            try:
                async def one(p):
                    out = await client.completions.create(
                        model=model, prompt=p, max_tokens=12, temperature=0)
                    return p, out.choices[0].text
                return await asyncio.gather(*(one(p) for p in ids * 3))
            finally:
                await client.close()

        got = []
        places: set[str] = set()
        for _ in range(5):          # bursts until both paths were taken (bounded)
            got += asyncio.run(burst())
            recs = _records(d)
            places = {r["prefill_worker"] for r in recs}
            if places == {"prefill0", "decode0"}:
                break
        # the decode worker's own prompts show as its prefill iterations (they reach the
        # daemon with the worker's stats: waited for, not assumed)
        deadline = time.monotonic() + 20
        while True:
            metrics = http("GET", f"{d.url}/metrics")[2].decode()
            series = [line for line in metrics.splitlines()
                      if line.startswith("applianced_engine_iterations_total{")
                      and 'worker="decode0"' in line and 'phase="prefill"' in line]
            if series or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        d.stop()
    assert places == {"prefill0", "decode0"}, places
    assert all(r["decode_worker"] == "decode0" and r["status"] == "ok" for r in recs)
    assert len(series) == 1 and float(series[0].rsplit(" ", 1)[1]) >= 1, series
    for p, text in got:
        assert text == tok.decode(want[tuple(p)]), (p, text)
