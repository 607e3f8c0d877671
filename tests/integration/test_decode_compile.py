"""`[engine] compile = "decode"` (torch.compile of a decode step's residual adds and norms,
`layers.glue`) gives the same greedy tokens as eager, in bf16 where the CPU has it (else
fp32), and its compiled functions equal the eager ones at batch sizes it was not warmed up
on (dynamic shapes, no recompile per size): bit for bit in bf16, within an fp32 ulp in fp32. Skipped where no C++ compiler
exists (inductor's CPU backend needs one; the engine then runs eager, see
tests/unit/test_decode_glue.py). Integration: inductor runs the compiler as a subprocess."""
from __future__ import annotations

import pytest
import torch

from appliance.engines import dtypes
from appliance.engines.layers import glue
from appliance.engines.loader import load_model
from appliance.engines.messages import Prefill, SamplingParams, Tokens
from appliance.engines.torch_engine import TorchEngine

pytestmark = pytest.mark.skipif(glue.compiler_missing() is not None,
                                reason=f"inductor needs a C++ compiler: {glue.compiler_missing()}")

DTYPE = torch.bfloat16 if dtypes.cpu_supports(torch.bfloat16, dtypes.cpu_flags()) else torch.float32


def _greedy(model, prompts, new_tokens: int, compile_mode: str) -> dict[str, list[int]]:
    eng = TorchEngine(model=model, worker="w", devices=("cpu",), num_blocks=128, block_size=16,
                      max_batch_tokens=4096, max_seqs=16, max_context=512, eos_token_ids=(),
                      share_pool=False)
    eng.set_compile(compile_mode)
    assert model.decode_glue.compiled == (compile_mode == "decode")
    for i, p in enumerate(prompts):
        eng.add(Prefill(f"r{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                   ignore_eos=True), handoff=False))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, Tokens):
                out.setdefault(ev.request_id, []).extend(ev.tokens)
    return out


def test_compiled_decode_gives_the_same_tokens(tiny_model):
    model = load_model(tiny_model, dtype=DTYPE)
    g = torch.Generator().manual_seed(3)
    vocab = model.shape.vocab_size
    # different lengths: decode batches of 5, then fewer as the short requests end
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (7, 30, 61, 12, 90)]
    eager = _greedy(model, prompts, 24, "off")
    compiled = _greedy(model, prompts, 24, "decode")
    assert compiled == eager
    # everything was compiled at start-up (set_compile): no batch size compiles again in
    # a step, with a request waiting for it (a batch of 1 included)
    from torch._dynamo.utils import counters
    warm = counters["stats"]["unique_graphs"]
    for n in (1, 3):        # engines on the same model, its compiled glue kept
        eng = TorchEngine(model=model, worker="w", devices=("cpu",), num_blocks=64,
                          block_size=16, max_batch_tokens=4096, max_seqs=8, max_context=512,
                          eos_token_ids=(), share_pool=False)
        for i, p in enumerate(prompts[:n]):
            eng.add(Prefill(f"s{i}", p, SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True), handoff=False))
        while eng.has_work():
            eng.step()
    assert counters["stats"]["unique_graphs"] == warm
    assert all(len(t) == 24 for t in compiled.values())


def _same(got: torch.Tensor, want: torch.Tensor, rows: int) -> None:
    """Bit for bit in bf16. In fp32 the norm's mean of squares may be summed in another
    order: inductor vectorizes it to the CPU's lanes, 8 on an AVX2 core (seen there: a few
    outputs of 7 rows one fp32 ulp apart), where the final rounding to bf16 hides it."""
    if DTYPE == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-7, msg=f"{rows} rows")
    else:
        assert torch.equal(got, want), rows


def test_compiled_glue_equals_eager_at_new_sizes():
    hidden = 48
    comp = glue.compile_glue(torch.device("cpu"), DTYPE, hidden, 1e-6, worker="t")
    assert comp.compiled
    eager = glue.eager_glue()
    g = torch.Generator().manual_seed(0)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DTYPE)
    for rows in (1, 7, 33):
        h = torch.randn(rows, hidden, generator=g).to(DTYPE)
        d = torch.randn(rows, hidden, generator=g).to(DTYPE)
        with torch.inference_mode():
            ch, cx = comp.add_rms_norm(h, d, w, 1e-6)
            eh, ex = eager.add_rms_norm(h, d, w, 1e-6)
            assert torch.equal(ch, eh), rows        # the residual add: no reduction
            _same(cx, ex, rows)
            _same(comp.rms_norm(h, w, 1e-6), eager.rms_norm(h, w, 1e-6), rows)
