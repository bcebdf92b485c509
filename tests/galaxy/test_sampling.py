"""The sampler against a by-hand reference, and the decode loop's stops over local rings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from services.lib.galaxy import model, sampling, sources
from services.lib.galaxy.sampling import GREEDY, Sampler, finish_reason, uniform
from services.worker.galaxy import hmp
from services.worker.galaxy.hmp import RingLayout
from services.worker.galaxy.ring import LocalRing
from tests.galaxy.test_collectives import run_on_ring

DECODER = TransformerConfig("decoder", 2, 32, 4, 64, 50, 32, 1e-5)
GALAXY3 = RingLayout("galaxy", (2, 1, 1), (22, 21, 21), (3, 2, 2))
LOCAL = RingLayout("local", (4,), (64,), (5,))


def _by_hand(logits: np.ndarray, temperature: float, top_p: float, u: float) -> int:
    """Top-p sampling written out plainly in numpy: the reference the sampler must equal."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    total, kept = 0.0, []
    for i in order:
        if total >= top_p:
            break
        kept.append(int(i))
        total += p[i]
    mass = np.array([p[i] for i in kept])
    cdf = np.cumsum(mass / mass.sum())
    for i, c in zip(kept, cdf, strict=True):
        if u < c:
            return i
    return kept[-1]


def test_greedy_is_argmax_and_lowest_id_among_equals() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0])
    assert GREEDY(logits, 0) == 1
    assert Sampler(0.0, 0.3, seed=9)(logits, 5) == 1  # top_p and seed do not matter greedily


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.3, 0.2)])
def test_sampling_equals_the_by_hand_reference(temperature: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(3)
    for step in range(60):
        logits = torch.randn(40, generator=gen) * 2
        sampler = Sampler(temperature, top_p, seed=11)
        want = _by_hand(logits.numpy(), temperature, top_p, uniform(11, step))
        assert sampler(logits, step) == want


def test_nucleus_keeps_the_smallest_set_reaching_top_p_with_ties_in_id_order() -> None:
    # probabilities 0.25 each for ids 0..3 at temperature 1: half the mass is ids 0 and 1
    tokens, probs = sampling.nucleus(torch.zeros(4), 1.0, 0.5)
    assert tokens.tolist() == [0, 1]
    assert probs.tolist() == [0.5, 0.5]
    tokens, _ = sampling.nucleus(torch.tensor([0.0, 3.0, 0.0, 3.0]), 1.0, 0.51)
    assert tokens.tolist() == [1, 3]


def test_draws_follow_the_nucleus_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(1.0, 0.8, seed=4)  # nucleus {0, 1}: renormalised 0.625 / 0.375
    draws = [sampler(logits, step) for step in range(4000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / len(draws) - 0.625) < 0.03  # fixed seeds: deterministic


def test_the_same_seed_and_step_give_the_same_token_and_others_differ() -> None:
    logits = torch.zeros(1000)
    a = [Sampler(1.0, 1.0, seed=1)(logits, s) for s in range(20)]
    assert a == [Sampler(1.0, 1.0, seed=1)(logits, s) for s in range(20)]
    assert a != [Sampler(1.0, 1.0, seed=2)(logits, s) for s in range(20)]
    assert len(set(a)) > 10  # each step draws anew


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_meaningless_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Sampler(**kwargs)  # type: ignore[arg-type]


def test_finish_reason() -> None:
    assert finish_reason([1, 2], 5) == "stop"
    assert finish_reason([1, 2, 3], 3) == "length"
    assert finish_reason([], 0) == "length"


def test_greedy_decoding_equals_transformers_generate() -> None:
    hf = sources.transformers_model(DECODER, seed=3)
    w = sources.transformers_weights(DECODER, seed=3)
    prompt = torch.tensor([5, 17, 3, 41, 8])
    want = hf.generate(  # type: ignore[operator]
        prompt[None],
        attention_mask=torch.ones(1, 5, dtype=torch.long),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )[0, 5:].tolist()
    assert hmp.generate(None, LOCAL, w, DECODER, prompt, 8) == want
    got = run_on_ring(3, lambda r: hmp.generate(r, GALAXY3, w, DECODER, prompt, 8, timeout_s=10))
    assert got == [want] * 3


def _reference_sampling(
    w: dict[str, torch.Tensor], prompt: torch.Tensor, n: int, sampler: Sampler
) -> list[int]:
    """Sampling on one device without a cache: the whole sequence re-run at every step."""
    seq, out = prompt, []
    with torch.no_grad():
        for step in range(n):
            token = sampler(model.forward(seq, w, DECODER)[-1], step)
            out.append(token)
            seq = torch.cat([seq, torch.tensor([token])])
    return out


def test_seeded_sampling_on_a_ring_equals_the_single_device_reference() -> None:
    w = sources.transformers_weights(DECODER, seed=3)
    prompt = torch.tensor([5, 17, 3, 41, 8])
    sampler = Sampler(1.0, 0.9, seed=7)
    want = _reference_sampling(w, prompt, 10, sampler)
    got = run_on_ring(
        3, lambda r: hmp.generate(r, GALAXY3, w, DECODER, prompt, 10, sampler=sampler, timeout_s=10)
    )
    assert got == [want] * 3
    assert want != _reference_sampling(w, prompt, 10, GREEDY)


def test_generation_ends_at_a_stop_token_which_is_left_out() -> None:
    w = sources.transformers_weights(DECODER, seed=3)
    prompt = torch.tensor([5, 17, 3, 41, 8])
    sampler = Sampler(1.2, 1.0, seed=5)
    full = hmp.generate(None, LOCAL, w, DECODER, prompt, 12, sampler=sampler)
    stop = full[4]
    cut = full[: full.index(stop)]
    seen: list[list[int]] = [[], [], []]

    def body(r: LocalRing) -> list[int]:
        return hmp.generate(
            r,
            GALAXY3,
            w,
            DECODER,
            prompt,
            12,
            sampler=sampler,
            stop=[stop, 999],
            on_token=seen[r.rank].append,
            timeout_s=10,
        )

    got = run_on_ring(3, body)
    assert got == [cut] * 3
    assert seen == [cut] * 3  # the callback saw every token kept, and not the stop token
    assert finish_reason(cut, 12) == "stop"
