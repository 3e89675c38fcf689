"""Artifacts and collapse: what a model's responses look like, as pure functions of the texts.

A method that trains on its own outputs can amplify a pattern until it is most of every response
(the starter's SDPO family ended up writing "The correct answer is 25." to the token cap). These
functions compare a row's completions with row 0's (the base model's on the same items):

- :func:`pattern_rates`: how often each word n-gram occurs per response (a pattern written five
  times in every response has rate 5);
- :func:`artifact_report`: the most frequent patterns now and their rate at row 0, the ones whose
  rate grew by at least `growth` (artifact amplification), length inflation (mean words now over
  row 0's), the share of repetitive responses (one n-gram at least `repeat_limit` times) and of
  responses that never ended (hit the token cap), when known;
- :func:`collapse_evidence`: the reasons a row counts as collapsed: every stream column below a
  score floor, or most responses degenerate (repetitive or never ending).

Words are runs of letters and digits or single other characters, so "\\boxed{25}" is the words
`\\`, `boxed`, `{`, `25`, `}` and a pattern survives changes of spacing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def ngrams(text: str, n: int) -> list[str]:
    """The word n-grams of `text`, each joined by single spaces."""
    tokens = words(text)
    return [" ".join(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def max_repeat(text: str, n: int) -> int:
    """How many times the most frequent n-gram of `text` occurs in it (0 for a short text)."""
    counts = Counter(ngrams(text, n))
    return max(counts.values(), default=0)


def pattern_rates(texts: Sequence[str], n: int) -> Counter[str]:
    """Occurrences of each n-gram per response, averaged over `texts`."""
    total: Counter[str] = Counter()
    for text in texts:
        total.update(ngrams(text, n))
    return Counter({gram: count / max(len(texts), 1) for gram, count in total.items()})


def artifact_report(texts: Sequence[str], base_texts: Sequence[str], *, n: int = 4,
                    top: int = 5, growth: float = 3.0, repeat_limit: int = 4,
                    ended: Sequence[bool] | None = None) -> dict[str, object]:
    """How the responses `texts` differ from `base_texts` (row 0's, the same items): see the
    module docstring. A pattern is amplified when its rate is at least `growth` times its rate
    at row 0 and it occurs at least twice per response (a pattern new since row 0 counts from
    a base rate of one occurrence per hundred responses). `ended[i]` says whether response i
    stopped before the token cap (None: not known)."""
    now, base = pattern_rates(texts, n), pattern_rates(base_texts, n)
    floor = 0.01
    patterns = [{"pattern": gram, "rate": rate, "base_rate": base.get(gram, 0.0),
                 "growth": rate / max(base.get(gram, 0.0), floor)}
                for gram, rate in now.most_common(top)]
    amplified = [p["pattern"] for p in patterns
                 if p["rate"] >= 2.0 and p["growth"] >= growth]  # type: ignore[operator]
    base_words = sum(len(words(t)) for t in base_texts) / max(len(base_texts), 1)
    now_words = sum(len(words(t)) for t in texts) / max(len(texts), 1)
    repetitive = sum(max_repeat(t, n) >= repeat_limit for t in texts) / max(len(texts), 1)
    return {
        "n": n, "patterns": patterns, "amplified": amplified,
        "length_inflation": now_words / base_words if base_words else None,
        "repetitive_share": repetitive,
        "never_ended_share": (None if ended is None
                              else sum(not e for e in ended) / max(len(ended), 1)),
    }


def collapse_evidence(stream_scores: Sequence[float | None], reports: Sequence[dict[str, object]],
                      *, score_floor: float = 0.02, degenerate_share: float = 0.5
                      ) -> list[str]:
    """Why a row counts as collapsed (empty: it does not): every stream column scored below
    `score_floor`, or in every column's report at least `degenerate_share` of the responses
    repetitive or never ending."""
    reasons = []
    scores = [s for s in stream_scores if s is not None]
    if scores and all(s < score_floor for s in scores):
        reasons.append(f"every stream column scored below {score_floor:g} "
                       f"({', '.join(f'{s:.3f}' for s in scores)})")

    def degenerate(report: dict[str, object]) -> float:
        shares = [report.get("repetitive_share"), report.get("never_ended_share")]
        return max(float(s) for s in shares if isinstance(s, (int, float)))

    if reports and all(degenerate(r) >= degenerate_share for r in reports):
        worst = min(degenerate(r) for r in reports)
        reasons.append(f"in every column at least {worst:.0%} of the responses are repetitive "
                       "or never end")
    return reasons
