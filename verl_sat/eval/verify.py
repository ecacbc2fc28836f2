"""The math verifier: answer extraction, MATH-style normalisation, equivalence on math-verify.

One function serves the AIME24 evaluation (docs/reproduce.md, "rule-based math verifier"), the training
reward and the validation reward: ``compute_score`` has verl's ``custom_reward_function``
signature, the paper recipe loads it with ``reward.custom_reward_function.path=
pkg://verl_sat.eval.verify`` (hydra_configs/sat_paper.yaml), and ``verl_sat.eval`` scores every
sample with it, so the reward the policy is trained on and the accuracy it is scored by are the
same computation.

Pipeline (docs/eval.md, "The verifier"):

1. ``extract_answer``: whichever comes last of the last ``\\boxed{...}`` (nested braces) and the
   last ``Answer:`` line (DAPO's format, which math-verify does not extract); else the last
   number in the response. Only this short answer reaches the symbolic back-ends, never the
   (possibly 32k-token) response.
2. ``normalize_answer``: MATH-style clean-up (Hendrycks et al. 2021, ``strip_string``): ``$``,
   ``\\text{}``, ``\\dfrac``/``\\tfrac``, ``\\left``/``\\right``, units, degrees, percent,
   thousands separators, trailing period, ``x =`` prefixes, leading zeros (``"025" == "25"``).
3. ``is_equivalent``: equal strings; else exact rational comparison of numbers (fast, and
   ``0.333 != 1/3``); else math-verify (``math_verify.parse`` + ``math_verify.verify``: LaTeX,
   intervals, sets, tuples, matrices, relations), floats compared to 12 decimals; a side it cannot
   parse is "not equal". Symbolic checks are screened for
   huge powers and factorials and run under a SIGALRM timeout in a main thread: the caller's, or,
   for callers in other threads (verl scores rewards in a thread pool, where math-verify's own
   ``signal.alarm`` timeouts fail, so they are off), a spawned worker process's, as verl's own
   math-verify reward does; a timeout or a parse error counts as "not equal".
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import re
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from fractions import Fraction
from typing import Any, TypeVar

_T = TypeVar("_T")

# Seconds a symbolic equivalence check may take before it counts as "not equivalent".
DEFAULT_TIMEOUT_S = 5.0
# Worker processes for checks called outside the main thread, and the longest wait for one.
POOL_WORKERS = 2
POOL_WAIT_S = 600.0
# Longest answer string handed to a symbolic backend (longer ones: string comparison only).
MAX_SYMBOLIC_LEN = 200
# Entries of each memo (normalised answers, parses, symbolic verdicts): a step's distinct answers.
_CACHE_SIZE = 1 << 16

# ---------------------------------------------------------------------------------------------
# 1. Extraction
# ---------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_LINE_RE = re.compile(
    r"^[\s>#*_]*(?:final\s+answer|answer)\s*(?:\*\*|__)?\s*[:：]\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE
)
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+/\d+|-?\d*\.\d+|-?\d+")


def _match_braces(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (None when unbalanced)."""
    depth = 0
    for i in range(open_idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _last_boxed(text: str) -> tuple[int, str] | None:
    """``(start, content)`` of the last ``\\boxed{...}`` / ``\\fbox{...}``, or None."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            end = _match_braces(text, start)
            if end is not None:
                return match.start(), text[start + 1 : end].strip()
        else:
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return match.start(), token.group(0)
    return None


def _last_answer_line(text: str) -> tuple[int, str] | None:
    """``(start, text)`` of the last non-empty ``Answer:`` / ``Final answer:`` line, or None."""
    for match in reversed(list(_ANSWER_LINE_RE.finditer(text))):
        line = match.group(1).strip().strip("*_").strip()
        if line:
            return match.start(), line
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the later of the last ``\\boxed{}`` and the last ``Answer:``
    line (a box on the Answer line counts as the box), else the last number, else None.

    The DAPO prompts of the training data ask for a last line ``Answer: <answer>``; the
    evaluation prompt asks for a box too. Whichever the response states last is its answer, so
    ``\\boxed{3} ... on reflection ... Answer: 4`` answers 4.
    """
    boxed, line = _last_boxed(response), _last_answer_line(response)
    if boxed is not None and (line is None or boxed[0] >= line[0]):
        return boxed[1]
    if line is not None:
        return line[1]
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------------------------
# 2. Normalisation
# ---------------------------------------------------------------------------------------------

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# Words that are mathematics, never units, so "2 pi" is not stripped to "2".
_MATH_WORDS = {"pi", "sqrt", "ln", "log", "sin", "cos", "tan", "exp", "oo", "inf", "infty", "and", "or"}
_KEPT_SPACE = "\x00"  # placeholder for a space that survives the removal of whitespace
_ROW_BREAK = "\x01"  # placeholder for a matrix's row break \\ while LaTeX spaces are removed
_NUM_WITH_UNIT_RE = re.compile(r"^(-?[\d.,/]*\d)\s*((?:[a-zA-Z]{2,}\.?\s*)+)(?:\^\{?\d\}?)?$")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}`` (MATH's ``_fix_fracs``)."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def normalize_answer(answer: str) -> str:
    """MATH-style canonical form of an answer string (spaces removed, so compare with ``==``)."""
    s = str(answer).strip().replace("\n", " ")
    # \\ is a doubly escaped backslash, except inside an environment (a matrix's row break)
    s = s.replace("\\\\", _ROW_BREAK if "\\begin{" in s else "\\")
    for latex_space in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(latex_space, " " if latex_space in ("\\ ", "~") else "")
    s = s.replace("\\$", "").replace("$", "")
    for delimiter in ("\\(", "\\)", "\\[", "\\]"):  # inline / display math delimiters
        s = s.replace(delimiter, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\left\s*|\\right\s*", "", s)
    s = s.replace("\\displaystyle", "")
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    while True:  # innermost \text{...} first, so nesting unwinds
        new = _TEXT_CMD_RE.sub(r" \1 ", s)
        if new == s:
            break
        s = new
    s = s.strip().rstrip(".").strip()
    unit = _NUM_WITH_UNIT_RE.match(s)
    if unit and not any(w.lower().rstrip(".") in _MATH_WORDS for w in unit.group(2).split()):
        s = unit.group(1)
    s = _fix_fracs(s)
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1" + _KEPT_SPACE, s)  # "\pi r" must not become "\pir"
    s = re.sub(r"\s+", "", s).replace(_KEPT_SPACE, " ")
    if re.fullmatch(r"[a-zA-Z]\w?=.+", s) and s.count("=") == 1:  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"[+-]?\d+", s):  # "025" -> "25", "+7" -> "7", "-0" -> "0"
        digits = s.lstrip("+-").lstrip("0") or "0"  # not int(s): Python refuses over 4300 digits
        s = "-" + digits if s.startswith("-") and digits != "0" else digits
    return s.replace(_ROW_BREAK, "\\\\")


# ---------------------------------------------------------------------------------------------
# 3. Equivalence
# ---------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised inside a symbolic check that ran past its time limit.

    A ``BaseException``, so that math-verify's and SymPy's ``except Exception`` cannot swallow it
    and carry on computing (nor math-verify's own ``except TimeoutException``: another class).
    """


# The alarm repeats every this many seconds until the work stops: an alarm whose exception is
# swallowed (it landed in a gc callback or a ``__del__``, where Python only reports it) is followed by another.
ALARM_REPEAT_S = 0.05
_alarm_armed = False


def _raise_timeout(signum: int, frame: Any) -> None:
    if _alarm_armed:  # a late alarm, after the work ended, does nothing
        raise _Timeout


def call_with_alarm(fn: Callable[[], _T], seconds: float) -> _T | None:
    """Run ``fn()`` in the main thread under a SIGALRM after ``seconds``; None if it raises or
    runs past that (the alarm interrupts it at its next Python instruction, as math-verify's own
    timeouts do; a single C call, e.g. a huge integer power, cannot be: ``_too_costly`` refuses those)."""
    global _alarm_armed
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        _alarm_armed = True
        signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
        try:
            return fn()
        finally:
            _alarm_armed = False  # first, before any call: an alarm handled after this line does nothing
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, _Timeout):
        return None
    finally:
        signal.signal(signal.SIGALRM, previous)


_POOL: ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ProcessPoolExecutor:
    """The spawned worker processes that run symbolic checks for callers outside the main thread
    (verl's own math-verify reward, ``verl.utils.reward_score.math_verify``, does the same)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(max_workers=POOL_WORKERS, mp_context=multiprocessing.get_context("spawn"))
        return _POOL


def _alarmed_check(pred: str, gt: str, seconds: float) -> bool:
    """``_symbolic_check`` under ``call_with_alarm``, in a main thread (a pool worker's runs its tasks)."""
    return bool(call_with_alarm(lambda: _symbolic_check(pred, gt), seconds))


def timed_symbolic_check(pred: str, gt: str, seconds: float) -> bool:
    """The symbolic check, stopped after ``seconds`` wherever it is called from.

    In the main thread (``python -m verl_sat.eval``) SIGALRM stops it in place. Elsewhere (verl's
    reward workers score in a thread pool, where ``signal`` refuses to install a handler) it runs
    in the main thread of a spawned worker process, under the same alarm; the caller waits at most
    ``POOL_WAIT_S`` (a guard for a worker stuck in C, not the timeout: a first call also waits
    for the workers to start). A dead worker, or that guard, gives "not equal".
    """
    global _POOL
    if threading.current_thread() is threading.main_thread():
        return _alarmed_check(pred, gt, seconds)
    try:
        return _pool().submit(_alarmed_check, pred, gt, seconds).result(timeout=POOL_WAIT_S)
    except BrokenProcessPool:  # a worker died (e.g. out of memory): start afresh next time
        with _POOL_LOCK:
            _POOL = None
        return False
    except FutureTimeout:
        return False


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised integer, decimal, ``a/b`` or ``\\frac{a}{b}``; else None."""
    s = s.replace("{", "(").replace("}", ")") if s.startswith("\\frac") else s
    m = re.fullmatch(r"(-?)\\frac\((-?\d+)\)\((-?\d+)\)", s)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    m = re.fullmatch(r"\(?([+-]?\d+(?:\.\d+)?)\)?/\(?([+-]?\d+(?:\.\d+)?)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return None if den == 0 else Fraction(m.group(1)) / den
        if re.fullmatch(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


# Exponents, factorials and powers of powers that SymPy may take unbounded time (or memory) on.
_BIG_EXPONENT_DIGITS = 5  # 10^{9999} is evaluated; 10^{10000} is refused
_BIG_FACTORIAL_RE = re.compile(r"\d{5,}\s*!")
_MAX_POWERS = 4


def _exponent(s: str, caret: int) -> str:
    """The exponent after the ``^`` at ``caret``: a braced group, a command with its braces, or a token."""
    i = caret + 1
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        end = _match_braces(s, i)
        return s[i:] if end is None else s[i + 1 : end]
    token = re.match(r"\\[a-zA-Z]+|\d+|.", s[i:])
    return token.group(0) if token else ""


def _too_costly(latex: str) -> bool:
    """True for answers a symbolic back-end should not evaluate (they count as "not equal").

    Longer than ``MAX_SYMBOLIC_LEN``; more than ``_MAX_POWERS`` powers; a power in an exponent
    (``10^{10^{10}}``); an exponent of ``_BIG_EXPONENT_DIGITS`` or more digits; a factorial of a
    number of 5 or more digits.
    """
    if len(latex) > MAX_SYMBOLIC_LEN or latex.count("^") > _MAX_POWERS or _BIG_FACTORIAL_RE.search(latex):
        return True
    for caret in (i for i, ch in enumerate(latex) if ch == "^"):
        exponent = _exponent(latex, caret)
        if "^" in exponent or "!" in exponent or re.search(rf"\d{{{_BIG_EXPONENT_DIGITS},}}", exponent):
            return True
    return False


# math-verify compares floats after rounding both sides to this many decimals (its default, 6,
# would take 1.414214 for sqrt(2)); exact decimals never get here (``to_number``).
FLOAT_ROUNDING = 12


class _QuietDisabledTimeout(logging.Filter):
    """Drops math-verify's one-time warning that its timeout is off: ``call_with_alarm`` is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(_QuietDisabledTimeout())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _math_verify_parse(answer: str) -> tuple[Any, ...]:
    """math-verify's parse of one normalised answer, as a ``\\boxed{}`` LaTeX expression (cached).

    Only LaTeX extraction: math-verify's plain-expression extractor hands strings to SymPy's
    ``parse_expr``, which evaluates Python. ``parsing_timeout=None``: math-verify's timeout uses
    ``signal.alarm``, which raises outside the main thread; ``call_with_alarm`` bounds it instead.
    """
    import math_verify

    return tuple(
        math_verify.parse(
            f"\\boxed{{{answer}}}",
            extraction_config=[math_verify.LatexExtractionConfig()],
            parsing_timeout=None,
        )
    )


def _symbolic_check(pred: str, gt: str) -> bool:
    """math-verify's verdict on two normalised answers; a side it cannot parse is "not equal"."""
    import math_verify
    import sympy

    gold, answer = _math_verify_parse(gt), _math_verify_parse(pred)
    parsed = (sympy.Basic, sympy.MatrixBase)
    if not any(isinstance(x, parsed) for x in gold) or not any(isinstance(x, parsed) for x in answer):
        return False
    return bool(math_verify.verify(list(gold), list(answer), float_rounding=FLOAT_ROUNDING, timeout_seconds=None))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _symbolic_equal(pred: str, gt: str, timeout: float) -> bool:
    """``_symbolic_check`` under ``timeout``, cached (16 samples of a prompt share the ground
    truth, and many share the answer); refused, failed or timed-out checks are "not equal"."""
    if _too_costly(pred) or _too_costly(gt):
        return False
    return timed_symbolic_check(pred, gt, timeout)


def is_equivalent(pred: str, ground_truth: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two answer strings are mathematically the same (both get ``normalize_answer``)."""
    a, b = normalize_answer(pred), normalize_answer(ground_truth)
    if not a or not b:
        return False
    if a == b:
        return True
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb
    if na is not None and nb is None and re.fullmatch(r"[\d.+-]+", b):
        return False
    return _symbolic_equal(a, b, timeout)


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def _ground_truth_answer(ground_truth: str) -> str:
    """A ground truth may itself be a full solution: take its boxed answer when it has one."""
    boxed = _last_boxed(ground_truth)
    return boxed[1] if boxed is not None else ground_truth


def verify(response: str, ground_truth: str) -> bool:
    """True when the final answer of ``response`` equals ``ground_truth`` (see module docstring)."""
    answer = extract_answer(response)
    if answer is None:
        return False
    return is_equivalent(answer, _ground_truth_answer(str(ground_truth)))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | int | Sequence[str],
    extra_info: dict[str, Any] | None = None,
) -> float:
    """verl ``custom_reward_function``: 1.0 when the response is correct, else 0.0.

    ``ground_truth`` may be a string, an int (AIME) or a list of accepted answers.
    ``data_source`` and ``extra_info`` are accepted for verl's signature and ignored.
    """
    truths = [ground_truth] if isinstance(ground_truth, (str, int)) else list(ground_truth)
    return 1.0 if any(verify(solution_str, str(t)) for t in truths) else 0.0
