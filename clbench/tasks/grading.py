"""Answer extraction and comparison shared by the graders, bounded in time on any input.

What lives here:
- extraction: the last ``\\boxed{...}`` (brace nesting handled in one linear scan), the last
  ``<answer>...</answer>``, the last ``Answer: ...`` line, and a multiple-choice letter;
- normalisation: LaTeX wrappers stripped, numbers parsed exactly (fractions, decimals, thousands
  separators, scientific notation) with caps on digits and exponents;
- comparison: exact match first, then exact numeric equality, then `math_verify` under a
  wall-clock guard and on bounded input only.

Every function here is pure and returns within a few milliseconds on 100k characters of
adversarial text; only :func:`math_equivalent` may spend up to :data:`VERIFY_BUDGET_S`.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from functools import lru_cache

#: Answers longer than this are never handed to sympy (parsing cost grows with length).
MAX_VERIFY_CHARS = 200
#: Numbers with more digits, or exponents larger than this, are not parsed (they would stall).
MAX_NUMBER_DIGITS = 400
#: Wall-clock budget of one math_verify comparison (only enforced in the main thread).
VERIFY_BUDGET_S = 0.5
#: Extractors look at this many trailing characters only: final answers sit at the end, and
#: a bounded window keeps every scan cheap on 100k-character completions.
MAX_SCAN_CHARS = 20_000
#: Longer candidate answers are wrong without further comparison.
MAX_ANSWER_CHARS = 2_000
#: Feedback quotes at most this many characters of a model's answer.
FEEDBACK_QUOTE_CHARS = 60

_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), or None.

    One left-to-right scan with a brace stack, so deep nesting costs linear time. `\\{` and `\\}`
    are literal braces. When boxes nest, the outermost one that closes last wins, and a content
    that is itself a single box (``\\boxed{\\boxed{5}}``) is unwrapped.
    """
    text = text[-MAX_SCAN_CHARS:]
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    stack: list[tuple[bool, int]] = []   # (opened by a box command, content start)
    last: tuple[int, int] | None = None
    for m in _BOX_TOKEN.finditer(text):
        tok = m.group()
        if tok in ("\\{", "\\}"):
            continue
        if tok == "}":
            if stack:
                is_box, start = stack.pop()
                if is_box:
                    last = (start, m.start())
        elif tok == "{":
            stack.append((False, m.end()))
        else:
            stack.append((True, m.end()))
    if last is None:
        return None
    content = text[last[0]:last[1]].strip()
    for _ in range(8):  # unwrap \boxed{\boxed{x}}; bounded so a pathological input stays cheap
        inner = _single_box(content)
        if inner is None:
            break
        content = inner
    return content


def _single_box(content: str) -> str | None:
    """If `content` is exactly one box, its inner text."""
    m = re.match(r"\\(?:boxed|fbox)\s*\{", content)
    if not m or not content.endswith("}"):
        return None
    inner = extract_boxed(content) if len(content) < 10_000 else None
    if inner is not None and content == content[:m.end()] + inner + "}":
        return inner
    return None


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` pair (case-insensitive), or None."""
    text = text[-MAX_SCAN_CHARS:]
    low = text.lower()
    close = low.rfind(f"</{tag}>")
    if close < 0:
        return None
    open_ = low.rfind(f"<{tag}>", 0, close)
    if open_ < 0:
        return None
    return text[open_ + len(tag) + 2:close].strip()


_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:：]", re.IGNORECASE)


def extract_answer_line(text: str) -> str | None:
    """What follows the last ``Answer:`` on its line (markdown emphasis removed)."""
    text = text[-MAX_SCAN_CHARS:]
    low = text.lower()
    pos = low.rfind("answer")
    for _ in range(50):  # the last few mentions of "answer" are enough; bounded on spam
        if pos < 0:
            break
        m = _ANSWER_LINE.match(text, pos)
        if m is not None:
            end = text.find("\n", m.end())
            value = text[m.end(): end if end >= 0 else len(text)]
            value = value.strip().strip("*_`").strip()
            return value or None
        pos = low.rfind("answer", 0, pos)
    return None


_LETTER_ONLY = re.compile(r"^\(?\s*([A-Za-z])\s*[).:]?$")
_STANDALONE = re.compile(r"(?<![A-Za-z0-9])\(?([A-Z])\)?(?![A-Za-z0-9])")


def extract_choice(text: str, letters: str = "ABCD") -> str | None:
    """The chosen option letter: `<answer>X</answer>`, then `Answer: X`, then `\\boxed{X}`, then
    the standalone capital letter among `letters` on the last non-empty line, if it names
    only one.

    "A" used as an article ("A gas forms") is not read as a choice: an "A" followed by a space
    and a lowercase word is skipped.
    """
    valid = set(letters.upper())
    for candidate in (extract_tag(text), extract_answer_line(text), extract_boxed(text)):
        if candidate is None:
            continue
        letter = _leading_letter(candidate)
        if letter is not None and letter in valid:
            return letter
    lines = [ln for ln in text[-5000:].splitlines() if ln.strip()]
    if not lines:
        return None
    last_line = lines[-1]
    found: set[str] = set()
    for m in _STANDALONE.finditer(last_line):
        letter = m.group(1)
        if letter not in valid:
            continue
        after = last_line[m.end():m.end() + 2]
        if letter == "A" and len(after) == 2 and after[0] == " " and after[1].islower():
            continue
        found.add(letter)
    # A line naming several options ("A or C?") commits to none of them.
    return found.pop() if len(found) == 1 else None


def _leading_letter(candidate: str) -> str | None:
    """`B`, `(B)`, `B.`, `B) water`, `\\text{B}` -> `B`."""
    c = strip_latex_wrappers(candidate[:200]).strip()
    m = _LETTER_ONLY.match(c)
    if m:
        return m.group(1).upper()
    m = re.match(r"^\(?([A-Za-z])[).:]\s", c)
    return m.group(1).upper() if m else None


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")


def strip_latex_wrappers(s: str) -> str:
    """Remove math delimiters, spacing commands, `\\left`/`\\right` and `\\text{}` wrappers."""
    s = s.strip().rstrip(".").strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b) and len(s) >= len(a) + len(b):
            s = s[len(a):len(s) - len(b)].strip()
    s = _TEXT_CMD.sub(r"\1", s)
    for cmd in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle"):
        s = s.replace(cmd, "")
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip()


def normalize_answer(s: str) -> str:
    """Canonical string form used for exact matching: wrappers, spaces and a final period gone."""
    s = strip_latex_wrappers(s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


_NUMBER = re.compile(
    r"^(?P<sign>[-+−]?)(?P<int>\d{1,3}(?:,\d{3})+|\d*)(?:\.(?P<frac>\d*))?"
    r"(?:(?:[eE](?P<exp>[-+]?\d+))|(?:(?:\\times|\*|×|x)10\^\{?(?P<exp2>[-+−]?\d+)\}?))?$")
_FRAC = re.compile(r"^(?P<sign>[-+−]?)\\frac\{(?P<num>[^{}]+)\}\{(?P<den>[^{}]+)\}$")


def parse_number(s: str) -> Fraction | None:
    """Exact value of a plain numeric answer, or None.

    Accepts integers (with `,` thousands separators), decimals, `a/b`, `\\frac{a}{b}`, scientific
    notation (`1.2e3`, `1.2 \\times 10^{3}`), a leading `$`/sign; refuses anything with more than
    :data:`MAX_NUMBER_DIGITS` digits or exponent so that huge inputs cannot stall the grader.
    """
    s = normalize_answer(s)
    if s.startswith("\\$"):
        s = s[2:]
    if not s or len(s) > MAX_NUMBER_DIGITS + 40:
        return None
    m = _FRAC.match(s)
    if m:
        num, den = parse_number(m.group("num")), parse_number(m.group("den"))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group("sign") in ("-", "−") else value
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = parse_number(a), parse_number(b)
        if num is None or den is None or den == 0:
            return None
        return num / den
    m = _NUMBER.match(s)
    if not m or not (m.group("int") or m.group("frac")):
        return None
    digits = (m.group("int") or "").replace(",", "") + (m.group("frac") or "")
    exp_text = m.group("exp") or m.group("exp2") or "0"
    exp = int(exp_text.replace("−", "-"))
    if len(digits) > MAX_NUMBER_DIGITS or abs(exp) > MAX_NUMBER_DIGITS:
        return None
    value = Fraction(int(digits or "0"), 10 ** len(m.group("frac") or ""))
    value *= Fraction(10) ** exp
    return -value if m.group("sign") in ("-", "−") else value


def numbers_close(a: Fraction, b: Fraction, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """`a == b` exactly when both tolerances are 0, else within max(rel_tol*|b|, abs_tol)."""
    if rel_tol == 0.0 and abs_tol == 0.0:
        return a == b
    return abs(a - b) <= max(Fraction(rel_tol) * abs(b), Fraction(abs_tol))


def format_number(value: Fraction | float | int, places: int = 6) -> str:
    """Shortest plain decimal of a number: 2500, 0.25, 58.44 (no exponent, no trailing zeros)."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.{places}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def quote(answer: str) -> str:
    """A model's answer, shortened for feedback text."""
    answer = " ".join(answer.split())
    if len(answer) > FEEDBACK_QUOTE_CHARS:
        answer = answer[:FEEDBACK_QUOTE_CHARS - 3] + "..."
    return answer


# ---------------------------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------------------------

class TimeLimitExceeded(BaseException):
    """Raised inside the guarded block when its budget is spent (a BaseException so that the
    verifier's own `except Exception` handlers cannot swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` in the guarded block after `seconds` (main thread only).

    Uses an interval timer (sub-second, unlike `signal.alarm`); restores any timer and handler
    that was set before. In other threads signals are unavailable and the block runs unguarded,
    which is why callers also bound their input size.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal,
                                                                                  "setitimer"):
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise TimeLimitExceeded()

    old_handler = signal.signal(signal.SIGALRM, _raise)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, old_delay, old_interval)


# Power towers and factorials of big numbers are what makes sympy stall on short inputs.
_DANGEROUS = re.compile(r"\^\s*\{?[^}]*\^|\*\*[^*]*\*\*|\d{3,}\s*!|\^\s*\{?\s*\d{4,}|\*\*\s*\d{4,}")


def _safe_for_sympy(expr: str) -> bool:
    return len(expr) <= MAX_VERIFY_CHARS and not _DANGEROUS.search(expr)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    from math_verify import parse
    return tuple(parse("\\boxed{" + gold + "}", parsing_timeout=None))  # type: ignore[arg-type]


#: One comparison per kind of answer whose first use loads more of sympy (radicals, fractions,
#: constants, intervals, polynomials): run once, unguarded, before any timed comparison.
_WARM_UP_PAIRS = (("(x+1)^2", "x^2+2x+1"), ("2\\sqrt{3}", "\\sqrt{12}"), ("0.5", "\\frac{1}{2}"),
                  ("\\frac{\\pi}{2}", "\\pi/2"), ("[0,1)", "[0,1)"))


@lru_cache(maxsize=1)
def warm_up_verifier() -> None:
    """Import math_verify and run a few comparisons unguarded (a few seconds, once per process).

    Its parsers and sympy's simplifiers load lazily; under the time limit a first comparison of a
    new kind (the first radical, say) would time out and grade a right answer wrong, and an
    import interrupted half-way leaves broken modules behind.
    """
    # math_verify warns once when its own signal.alarm timeouts are disabled; ours replace them
    # (its alarm would cancel our sub-second timer), so the warning is noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    for gold, pred in _WARM_UP_PAIRS:
        verify(parse("\\boxed{" + gold + "}", parsing_timeout=None),  # type: ignore[arg-type]
               parse("\\boxed{" + pred + "}", parsing_timeout=None), timeout_seconds=None)


def math_equivalent(pred: str, gold: str) -> bool:
    """Whether `pred` states the same mathematical answer as `gold`.

    Exact match of normalised strings, then exact numeric equality, then `math_verify` (symbolic
    equivalence) on inputs of at most :data:`MAX_VERIFY_CHARS` characters without power towers,
    under a :data:`VERIFY_BUDGET_S` wall-clock limit. Any failure of the verifier counts as "not
    equivalent".
    """
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p:
        return False
    if p == g:
        return True
    pn, gn = parse_number(p), parse_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    if not (_safe_for_sympy(p) and _safe_for_sympy(g)):
        return False
    warm_up_verifier()
    from math_verify import parse, verify

    try:
        with time_limit(VERIFY_BUDGET_S):
            gold_parsed = list(_parse_gold(g))
            pred_parsed = parse("\\boxed{" + p + "}",
                                parsing_timeout=None)  # type: ignore[arg-type]
            if not gold_parsed or not pred_parsed:
                return False
            return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except TimeLimitExceeded:
        return False
    except Exception:
        return False
