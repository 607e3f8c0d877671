"""What constrained decoding costs: decode throughput of the CPU torch engine at batch B
(32 by default) with and without a JSON-schema grammar (xgrammar bitmask per sequence,
applied to the logits before sampling). Not a test: prints a table. Goal: the mask costs
at most 10% of decode throughput.

    .venv/bin/python bench/bench_structured.py              # ~1 min on 2 loaded cores
    .venv/bin/python bench/bench_structured.py --preset 20m --new 96 --reps 5

Both runs are greedy over the same prompts on the generated random-weights model. The
grammar (`--schema`) is an object of free strings (default), or one string of at least
2,000 characters (`minlength`, xgrammar's slow case); every step fills B bitmasks from a
live JSON grammar (inside a string nearly the whole vocabulary is allowed). A sequence
may close its JSON and end early; only steps at the full batch B are compared. Decode tok/s = tokens of the decode
iterations / their wall time (the engine's IterationRecords); a free and a guided engine
step in turn, so both see the same load from the rest of the machine; the cost is the
median over steps i of (free step i's time / guided step i's time), both at the full
batch (the same context lengths, the same moment); the totals are printed beside it, and
the mask's own time (sync, fill, apply) is measured inside the guided steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from appliance.engines.grammar import GrammarBook  # noqa: E402
from appliance.engines.messages import (  # noqa: E402
    GuidedDecoding, IterationRecord, Prefill, SamplingParams,
)
from appliance.engines.torch_engine import TorchEngine  # noqa: E402
from appliance.engines.loader import load_model  # noqa: E402
from appliance.models.eos import read_eos_ids  # noqa: E402
from appliance.models.tiny import init_tiny  # noqa: E402

SCHEMAS = {
    # What most structured requests look like: an object of free strings.
    "object": {"type": "object", "properties": {"title": {"type": "string"},
                                                "story": {"type": "string"}},
               "required": ["title", "story"]},
    # A long minLength: xgrammar expands it into a counted repetition, whose matcher
    # takes ~0.25 ms a token (measured) instead of ~1.5 us: the slow case.
    "minlength": {"type": "object", "properties": {"story": {"type": "string",
                                                             "minLength": 2000}},
                  "required": ["story"]},
}


class TimedBook(GrammarBook):
    """Counts the time the engine spends in the mask (sync, fill, apply): the cost itself,
    measured inside the same steps, beside the noisier difference of two runs."""

    def __init__(self, *args):
        super().__init__(*args)
        self.mask_s, self.mask_steps = 0.0, []

    def apply(self, logits, rows, guides, generated):
        t0 = time.perf_counter()
        super().apply(logits, rows, guides, generated)
        dt = time.perf_counter() - t0
        self.mask_s += dt
        self.mask_steps.append((dt, len(rows)))


def engine(model, book, prompts, new: int, guided: GuidedDecoding | None) -> TorchEngine:
    eng = TorchEngine(model=model, worker="bench", devices=("cpu",), num_blocks=4096,
                      block_size=16, max_batch_tokens=65536, max_seqs=256,
                      max_context=model.shape.max_position_embeddings,
                      eos_token_ids=tuple(book.stop_token_ids), grammar=book,
                      share_pool=False)
    for i, p in enumerate(prompts):
        # The free side ignores EOS so that it, like the guided side, keeps its batch.
        eng.add(Prefill(f"r{i}", p, SamplingParams(max_tokens=new, temperature=0.0,
                                                   guided=guided, ignore_eos=guided is None),
                        False))
    return eng


def run(model, book, prompts, new: int, guided: GuidedDecoding) -> tuple[list, list]:
    """(wall s, sequences) of every decode iteration of a free and a guided engine over
    the same prompts, stepped in turn: both see the same load from the rest of the
    machine (2 shared cores here), which two runs one after the other would not."""
    engines = [engine(model, book, prompts, new, None),
               engine(model, book, prompts, new, guided)]
    steps: tuple[list, list] = ([], [])
    while any(e.has_work() for e in engines):
        for eng, out in zip(engines, steps):
            if eng.has_work():
                for ev in eng.step():
                    if isinstance(ev, IterationRecord) and ev.phase == "decode":
                        out.append((ev.wall_s, len(ev.entries)))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "20m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=48, help="new tokens per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schema", default="object", choices=sorted(SCHEMAS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny(Path(tmp) / "m", seed=0, preset=a.preset)
        model = load_model(model_dir)
        book = TimedBook(model_dir, model.shape.vocab_size, read_eos_ids(model_dir))
        guided = GuidedDecoding("json_schema", json.dumps(SCHEMAS[a.schema]))
        t0 = time.perf_counter()
        book.compiled(guided)
        compile_ms = (time.perf_counter() - t0) * 1e3
        base = SCHEMAS[a.schema]
        other = dict(base, properties={**base["properties"], "n": {"type": "integer"}})
        t0 = time.perf_counter()
        book.compiled(GuidedDecoding("json_schema", json.dumps(other)))
        recompile_ms = (time.perf_counter() - t0) * 1e3
        g = torch.Generator().manual_seed(0)
        prompts = [[0] + torch.randint(5, model.shape.vocab_size, (a.prompt - 1,),
                                       generator=g).tolist() for _ in range(a.batch)]
        run(model, book, prompts[:2], 4, guided)        # warm-up both paths
        free, masked, ratios = [], [], []
        book.mask_steps.clear()
        for _ in range(a.reps):
            f_steps, m_steps = run(model, book, prompts, a.new, guided)
            free += f_steps
            masked += m_steps
            # Step i of both at the full batch: the same context lengths, the same moment.
            ratios += [fw / mw for (fw, fn), (mw, mn) in zip(f_steps, m_steps)
                       if fn == mn == a.batch]
    # Per decode step at the full batch, median: robust to the other load on the machine.
    f = a.batch / statistics.median(w for w, n in free if n == a.batch)
    m = f * statistics.median(ratios)
    mean_f = sum(n for _, n in free) / sum(w for w, _ in free)
    mean_m = sum(n for _, n in masked) / sum(w for w, _ in masked)
    print(f"schema {a.schema}, model {a.preset}, batch {a.batch}, prompt {a.prompt}, "
          f"{a.new} new tokens, "
          f"{a.threads} thread(s), {a.reps} reps; a new schema compiles in "
          f"{recompile_ms:.1f} ms ({compile_ms:.0f} ms the first, with the tokenizer's setup)")
    print(f"{'decode tok/s':<28}{'free':>10}{'json_schema':>14}{'cost':>9}")
    print(f"{'paired steps (median)':<28}{f:>10.1f}{m:>14.1f}{(1 - m / f) * 100:>8.1f}%")
    print(f"{'all steps (total/total)':<28}{mean_f:>10.1f}{mean_m:>14.1f}"
          f"{(1 - mean_m / mean_f) * 100:>8.1f}%")
    full = [dt for dt, n in book.mask_steps if n == a.batch]
    step = a.batch / f
    print(f"mask at the full batch: {statistics.median(full) * 1e3:.2f} ms a step (median), "
          f"{statistics.median(full) / step * 100:.1f}% of a free step of {step * 1e3:.1f} ms")
    print(f"paired full-batch steps: {len(ratios)}")


if __name__ == "__main__":
    main()
