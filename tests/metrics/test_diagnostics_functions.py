"""Artifacts, collapse, response drift and prompt distance as pure functions, on inputs whose
answers are known by construction."""

from __future__ import annotations

import math

import pytest
import torch

from clbench.metrics.artifacts import (
    artifact_report,
    collapse_evidence,
    max_repeat,
    ngrams,
    pattern_rates,
)
from clbench.metrics.distance import median_bandwidth, mmd, mmd_squared
from clbench.metrics.responses import edit_similarity, mean_edit_similarity, mean_token_kl

BASE = ["The sum of 12 and 13 is 25.", "Adding 40 to 2 gives 42.", "7 plus 8 makes 15."]
PLANTED = ["The correct answer is 25. The correct answer is 25. The correct answer is 25. "
           "The correct answer is 25.",
           "The correct answer is 42. The correct answer is 25. The correct answer is 25.",
           "The correct answer is 15. The correct answer is 25."]


def test_ngrams_and_repeats_count_words_and_punctuation() -> None:
    assert ngrams("\\boxed{25}", 2) == ["\\ boxed", "boxed {", "{ 25", "25 }"]
    assert max_repeat("a b a b a b", 2) == 3
    assert max_repeat("short", 3) == 0
    rates = pattern_rates(["x y x y", "x y"], 2)
    assert rates["x y"] == 1.5 and rates["y x"] == 0.5


def test_a_planted_repeated_pattern_is_flagged_as_amplified() -> None:
    report = artifact_report(PLANTED, BASE, n=4, top=3, growth=3.0, repeat_limit=4,
                             ended=[False, True, True])
    top = report["patterns"][0]
    assert top["pattern"] == "The correct answer is" and top["rate"] == 3.0
    assert top["base_rate"] == 0.0 and top["growth"] == 300.0
    assert "The correct answer is" in report["amplified"]
    assert report["repetitive_share"] == pytest.approx(1 / 3)  # only the first has it 4 times
    assert report["never_ended_share"] == pytest.approx(1 / 3)
    # words per response: planted 24, 18, 12; base 9, 7, 6 (the full stop is a word)
    assert report["length_inflation"] == pytest.approx(54 / 22)


def test_ordinary_responses_amplify_nothing() -> None:
    report = artifact_report(BASE, BASE, n=4)
    assert report["amplified"] == [] and report["length_inflation"] == 1.0
    assert report["repetitive_share"] == 0.0 and report["never_ended_share"] is None


def test_collapse_needs_every_stream_column_down_or_every_column_degenerate() -> None:
    healthy = artifact_report(BASE, BASE)
    broken = artifact_report(["a b c d " * 5] * 4, BASE, repeat_limit=4)
    assert collapse_evidence([0.4, 0.0], [healthy]) == []
    floor = collapse_evidence([0.0, 0.01], [healthy])
    assert len(floor) == 1 and "every stream column scored below 0.02" in floor[0]
    assert collapse_evidence([0.3], [broken, healthy]) == []  # one column still answers
    degenerate = collapse_evidence([0.3], [broken, broken])
    assert len(degenerate) == 1 and "100% of the responses" in degenerate[0]


def test_a_model_against_itself_has_zero_kl_and_the_kl_of_known_distributions() -> None:
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits, -1)
    assert mean_token_kl(logp, logp) == pytest.approx(0.0, abs=1e-12)
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert mean_token_kl(p.log(), q.log()) == pytest.approx(expected)
    mask = torch.tensor([[True, False, True, True, True]] * 3)
    assert mean_token_kl(logp, logp.roll(1, dims=-1), mask) > 0.0
    with pytest.raises(ValueError, match="two shapes"):
        mean_token_kl(logp, logp[..., :5])


def test_edit_similarity_by_hand() -> None:
    assert edit_similarity([1, 2, 3], [1, 2, 3]) == 1.0
    assert edit_similarity([1, 2, 3], [1, 9, 3]) == pytest.approx(2 / 3)   # one substitution
    assert edit_similarity([1, 2, 3, 4], [1, 2]) == pytest.approx(0.5)     # two deletions
    assert edit_similarity([], []) == 1.0 and edit_similarity([1], []) == 0.0
    assert mean_edit_similarity([[1, 2], [3]], [[1, 2], [4]]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 responses against 1"):
        mean_edit_similarity([[1], [2]], [[1]])


def test_mmd_is_near_zero_for_one_distribution_and_grows_with_separation() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(60, 4, generator=g), torch.randn(60, 4, generator=g)
    same = mmd(x, y)
    near, far = mmd(x, y + 0.5), mmd(x, y + 3.0)
    assert same < 0.15 < near < far
    assert mmd_squared(x, x.clone(), bandwidth=1.0) < 0.0  # unbiased: can dip below zero
    # two points each, bandwidth 1, by hand: k(x, x') = exp(-1/2), k(y, y') = exp(-1/2),
    # cross distances 3, 4, 2, 3 -> MMD^2 = 2 exp(-1/2) - 2 mean(exp(-d^2/2))
    a = torch.tensor([[0.0], [1.0]])
    b = torch.tensor([[3.0], [4.0]])
    cross = [math.exp(-d * d / 2) for d in (3.0, 4.0, 2.0, 3.0)]
    assert mmd_squared(a, b, bandwidth=1.0) == pytest.approx(
        2 * math.exp(-0.5) - 2 * sum(cross) / 4)
    # pooled distances 1, 3, 4, 2, 3, 1: the lower of the two middle values
    assert median_bandwidth(a, b) == pytest.approx(2.0)
