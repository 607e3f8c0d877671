"""Fair shares on a running daemon: a swap-model workflow starts new cost terms for the
new model and keeps the old model's (the arithmetic: tests/unit/test_fair_shares.py)."""
from __future__ import annotations

import time


def test_a_model_swap_starts_new_terms_and_keeps_the_old_ones(daemon_factory, tiny_model):
    """On a running daemon: swap-model from the 70B shape to the 8B one (named "small");
    /admin/v1/usage then shows a fit for each model × device kind, the old one kept."""
    from helpers.daemons import http
    from test_chargeback import KEY_A, config, get
    d = daemon_factory("--devices", "sim:8xH100", "--model-spec", "llama-3.1-70b-fp8",
                       "--sim-speed", "50", model=tiny_model,
                       config=config("[workflows]\ndrain_timeout_s = 10.0\n"))
    c = d.client(KEY_A, timeout=60)

    def ask(model: str, n: int) -> None:
        for i in range(n):
            c.completions.create(model=model, prompt=[100 + i] * (20 + 7 * i), max_tokens=8,
                                 temperature=0, extra_body={"ignore_eos": True})

    ask("llama-3.1-70b-fp8", 6)
    code, _, body = d.post("/admin/v1/workflows", {"kind": "swap-model", "params": {
        "model": "llama-3.1-8b", "model_name": "small"}})
    assert code == 201, body
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        wf = http("GET", f"{d.url}/admin/v1/workflows/{body['id']}")[2]
        if wf["status"] in ("succeeded", "failed", "cancelled", "compensated"):
            break
        time.sleep(0.1)
    assert wf["status"] == "succeeded", wf
    ask("small", 6)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        code, _, usage = get(d, "/admin/v1/usage", since="1h")
        fits = {(f["model"], f["device"]): f for f in usage["calibration"]}
        if ("small", "H100-SXM") in fits and fits[("small", "H100-SXM")]["decode"]["samples"] >= 8:
            break
        time.sleep(0.5)
    assert ("llama-3.1-70b-fp8", "H100-SXM") in fits and ("small", "H100-SXM") in fits, fits
    old = fits[("llama-3.1-70b-fp8", "H100-SXM")]["decode"]["samples"]
    assert old >= 8
    time.sleep(3)
    code, _, usage = get(d, "/admin/v1/usage", since="1h")
    fits = {(f["model"], f["device"]): f for f in usage["calibration"]}
    assert fits[("llama-3.1-70b-fp8", "H100-SXM")]["decode"]["samples"] == old   # kept, not fed
