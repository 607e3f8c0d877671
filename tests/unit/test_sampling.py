"""The sampler's controls beyond temperature and top-p: top-k (and its order with top-p),
OpenAI's presence/frequency penalties and logit bias, and the log-probs it reports."""
from __future__ import annotations

import math

import pytest
import torch

from appliance.engines.sampling import SamplingState, sample, top_logprobs

V = 64


def three_way(p: list[float]) -> torch.Tensor:
    """Logits whose softmax is p on tokens 0..len(p)-1 and zero elsewhere."""
    row = torch.full((V,), float("-inf"))
    row[: len(p)] = torch.tensor(p).log()
    return row[None]


def draws(logits, n=300, **kw) -> set[int]:
    return {sample(logits, [SamplingState.create(1.0, seed=s, **kw)])[0] for s in range(n)}


def test_top_k_keeps_the_k_most_likely():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    best = logits[0].argsort(descending=True).tolist()
    assert draws(logits, top_k=1) == {best[0]}
    got = draws(logits, top_k=3)
    assert got == set(best[:3])          # all three turn up in 300 draws, nothing else
    assert len(draws(logits)) > 10       # without top-k the tail is sampled


def test_top_p_applies_to_what_top_k_kept():
    # 0.5 / 0.3 / 0.2. Top-p 0.6 alone keeps two tokens (0.5 < 0.6). After top-k 2 the
    # kept mass renormalizes to 0.625 / 0.375, and 0.625 alone reaches 0.6.
    logits = three_way([0.5, 0.3, 0.2])
    assert draws(logits, top_p=0.6) == {0, 1}
    assert draws(logits, top_p=0.6, top_k=2) == {0}
    assert draws(logits, top_k=2) == {0, 1}


def test_penalties_follow_openais_formula():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5], logits[0, 9] = 2.0, 1.6, 1.0
    generated = [3, 3, 5]

    def pick(**kw):
        return sample(logits, [SamplingState.create(0.0, **kw)], [generated])[0]

    assert pick() == 3
    # frequency 0.3: token 3 -> 2.0 - 0.6 = 1.4, token 5 -> 1.6 - 0.3 = 1.3: still 3
    assert pick(frequency_penalty=0.3) == 3
    # frequency 0.5: 3 -> 1.0, 5 -> 1.1, 9 -> 1.0: now 5
    assert pick(frequency_penalty=0.5) == 5
    # presence 0.8 counts once: 3 -> 1.2, 5 -> 0.8, 9 -> 1.0
    assert pick(presence_penalty=0.8) == 3
    assert pick(presence_penalty=1.5) == 9
    # negative penalties favour what was said: 9 never was
    logits[0, 9] = 2.2
    assert pick(presence_penalty=-0.5) == 3
    # the penalties come from `generated`, not from anything kept between calls
    assert sample(logits, [SamplingState.create(0.0, presence_penalty=1.5)], [[]])[0] == 9


def test_logit_bias_adds_to_the_logits():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    low = int(logits[0].argmin())
    forced = SamplingState.create(0.0, logit_bias=[(low, 100.0)], vocab_size=V)
    banned_best = SamplingState.create(0.0, logit_bias=[(int(logits[1].argmax()), -100.0)])
    out = sample(logits, [forced, banned_best])
    assert out[0] == low
    assert out[1] == int(logits[1].argsort(descending=True)[1])
    # sampled rows see the bias too
    assert draws(logits[:1], logit_bias=[(low, 100.0)]) == {low}


@pytest.mark.parametrize("kw,message", [
    (dict(top_k=-1), "top_k"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3.0), "presence_penalty"),
    (dict(logit_bias=[(V, 1.0)], vocab_size=V), "outside the vocabulary"),
    (dict(logit_bias=[(1, 101.0)]), "[-100, 100]"),
])
def test_bad_controls_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingState.create(1.0, **kw)


def test_seeded_rows_stay_independent_with_controls():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))

    def run(rows, states):
        return [sample(logits[rows], states, [[1, 2]] * len(rows)) for _ in range(6)]

    state = dict(top_k=8, frequency_penalty=0.4, logit_bias=[(4, 2.0)])
    alone = run([1], [SamplingState.create(0.9, seed=11, **state)])
    mixed = run([0, 1, 2], [SamplingState.create(0.0), SamplingState.create(0.9, seed=11, **state),
                            SamplingState.create(1.2, seed=3)])
    assert [r[0] for r in alone] == [r[1] for r in mixed]


def test_top_logprobs_are_the_models_log_softmax():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(7))
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1     # a tie: lower id first
    chosen = [5, 20]
    (lp0, alts0), (lp1, alts1) = top_logprobs(logits, chosen, 3)
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(lp0, float(ref[0, 5]), rel_tol=1e-6)
    assert [t for t, _ in alts0] == ref[0].argsort(descending=True)[:3].tolist()
    assert all(math.isclose(v, float(ref[0, t]), rel_tol=1e-6) for t, v in alts0)
    assert [t for t, _ in alts1[:2]] == [10, 20] and math.isclose(lp1, alts1[1][1])
    assert sum(math.exp(v) for _, v in alts0) < 1.0
    assert top_logprobs(logits, chosen, 0)[0][1] == []
    (_, (cut_at_tie,)) = top_logprobs(logits, chosen, 1)[1]    # the tie straddles k = 1
    assert cut_at_tie[0] == 10


def test_nucleus_and_top_k_agree_with_a_full_sort():
    """top-p and top-k look at a head of the distribution found by topk; what they keep
    must be what a stable sort of everything keeps (ties in id order included)."""
    g = torch.Generator().manual_seed(11)
    for peaked in (0.3, 3.0, 12.0):            # flat to sharp
        logits = torch.randn(1, V, generator=g) * peaked
        logits[0, 40] = logits[0, 41] = logits[0].max()      # a tie at the top
        for top_p, top_k in ((0.5, 0), (0.9, 0), (0.99, 0), (1.0, 5), (0.7, 9)):
            probs = torch.softmax(logits[0], -1)
            ref, ref_ids = torch.sort(probs, descending=True, stable=True)
            keep = V
            if top_k:
                keep = top_k
            if top_p < 1.0:
                cdf = ref[:keep].cumsum(0)
                keep = int(torch.searchsorted(cdf, top_p * cdf[-1]).item()) + 1
            allowed = set(ref_ids[:keep].tolist())
            got = draws(logits, 200, top_p=top_p, top_k=top_k)
            assert got <= allowed and (len(allowed) > 3 or got == allowed), (peaked, top_p)


# ---- vLLM's extensions: min_p, repetition_penalty, min_tokens ------------------------

def test_min_p_drops_tokens_below_a_share_of_the_likeliest():
    logits = three_way([0.5, 0.3, 0.2])       # 0.2 < 0.5 * 0.5; 0.3 is not
    assert draws(logits) == {0, 1, 2}
    assert draws(logits, min_p=0.5) == {0, 1}
    assert draws(logits, min_p=0.7) == {0}


def test_repetition_penalty_divides_seen_positive_logits_and_multiplies_negative():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.5, -1.0
    state = SamplingState.create(0.0, repetition_penalty=2.0)
    # Token 3 was seen (in the prompt): 2.0 / 2 = 1.0 < 1.5, so 4 wins.
    assert sample(logits, [state], [()], [[3, 3, 9]]) == [4]
    assert sample(logits, [SamplingState.create(0.0)], [()], [[3]]) == [3]
    # A seen negative logit goes further down: 5 at -2 stays below the zeros.
    flat = torch.zeros(1, V)
    flat[0, 5] = -1.0
    state = SamplingState.create(1.0, seed=0, repetition_penalty=2.0)
    probs_seen = [sample(flat, [SamplingState.create(1.0, seed=s, repetition_penalty=2.0)],
                         [()], [[5]])[0] for s in range(2000)].count(5)
    probs_not = [sample(flat, [SamplingState.create(1.0, seed=s)], [()], [[5]])[0]
                 for s in range(2000)].count(5)
    assert probs_seen < probs_not
    assert state.repeats and not SamplingState.create(1.0).repeats


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 7] = 50.0          # the stop token is by far the likeliest
    state = SamplingState.create(0.0, min_tokens=3, stop_ids=(7, 8))
    assert sample(logits, [state], [[1, 2]]) != [7]          # 2 generated < 3
    assert sample(logits, [state], [[1, 2, 3]]) == [7]       # 3 reached
    assert SamplingState.create(0.0, min_tokens=3).stop_ids is None   # nothing to mask


@pytest.mark.parametrize("kw, message", [
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 3.0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens")])
def test_bad_extensions_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingState.create(1.0, **kw)
