"""Rule-based math verifier: answer extraction, MATH-style normalisation, equivalence.

One verifier serves both the AIME24 evaluation (SPEC §7, "rule-based math verifier") and the
training reward (``compute_score`` has verl's ``custom_reward_function`` signature), so the
reward the policy is trained on and the accuracy it is scored by cannot drift apart.

Pipeline (docs/eval.md, "The verifier"):

1. ``extract_answer``: the content of the last ``\\boxed{...}`` (nested braces), else the text
   of the last ``Answer:`` line, else the last number in the response.
2. ``normalize_answer``: MATH-style clean-up (Hendrycks et al. 2021, ``strip_string``): ``$``,
   ``\\text{}``, ``\\dfrac``/``\\tfrac``, ``\\left``/``\\right``, units, degrees, percent,
   thousands separators, trailing period, ``x =`` prefixes, leading zeros (``"025" == "25"``).
3. ``is_equivalent``: equal strings; else exact rational comparison of numbers; else intervals,
   tuples and sets element by element; else ``math_verify`` if installed, else SymPy
   (fractions, radicals, pi). Symbolic checks run under a timeout; a timeout or a parse error
   falls back to the string comparison of step 1 (i.e. "not equal").
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, TypeVar

_T = TypeVar("_T")

# Seconds a symbolic equivalence check may take before it counts as "not equivalent".
DEFAULT_TIMEOUT_S = 5.0
# Longest answer string handed to a symbolic backend (longer ones: string comparison only).
MAX_SYMBOLIC_LEN = 200

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


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces, or None.

    ``\\boxed 5`` (no braces) yields ``"5"``; an unclosed last box is skipped for an earlier one.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            end = _match_braces(text, start)
            if end is not None:
                return text[start + 1 : end].strip()
        else:
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return token.group(0)
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last ``\\boxed{}``, else last ``Answer:`` line, else last number."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    lines = [m.group(1) for m in _ANSWER_LINE_RE.finditer(response)]
    lines = [line.strip().strip("*_").strip() for line in lines]
    lines = [line for line in lines if line]
    if lines:
        return lines[-1]
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------------------------
# 2. Normalisation
# ---------------------------------------------------------------------------------------------

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# Words that are mathematics, never units, so "2 pi" is not stripped to "2".
_MATH_WORDS = {"pi", "sqrt", "ln", "log", "sin", "cos", "tan", "exp", "oo", "inf", "infty", "and", "or"}
_KEPT_SPACE = "\x00"  # placeholder for a space that survives the removal of whitespace
_NUM_WITH_UNIT_RE = re.compile(r"^(-?[\d.,/]*\d)\s*((?:[a-zA-Z]{2,}\.?\s*)+)(?:\^\{?\d\}?)?$")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}`` (MATH's ``_fix_fracs``)."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)


def normalize_answer(answer: str) -> str:
    """MATH-style canonical form of an answer string (spaces removed, so compare with ``==``)."""
    s = str(answer).strip().replace("\n", " ")
    s = s.replace("\\\\", "\\")
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
        s = str(int(s))
    return s


# ---------------------------------------------------------------------------------------------
# 3. Equivalence
# ---------------------------------------------------------------------------------------------


class _Timeout(Exception):
    """Raised inside a symbolic check that ran past its time limit."""


def call_with_timeout(fn: Callable[[], _T], seconds: float) -> _T | None:
    """Run ``fn()``; return None if it raises or takes longer than ``seconds``.

    In the main thread (Unix) a SIGALRM interrupts the work; elsewhere (a thread pool) the work
    runs in a daemon thread that is abandoned at the deadline.
    """
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):

        def _raise(signum: int, frame: Any) -> None:
            raise _Timeout

        previous = signal.signal(signal.SIGALRM, _raise)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        except Exception:
            return None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: list[_T] = []

    def _target() -> None:
        try:
            box.append(fn())
        except Exception:
            pass

    worker = threading.Thread(target=_target, daemon=True)
    worker.start()
    worker.join(seconds)
    return box[0] if box else None


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


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside (), [], {}."""
    parts, depth, current = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _as_collection(s: str) -> tuple[str, list[str]] | None:
    """``(kind, items)`` for an interval/tuple ``(a,b]``, a set ``\\{a,b\\}`` or a bare list ``a,b``."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _split_top_level(s[2:-2])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        if _match_pairs(inner):
            items = _split_top_level(inner)
            if len(items) > 1:
                return s[0] + s[-1], items
    items = _split_top_level(s)
    return ("list", items) if len(items) > 1 else None


def _match_pairs(s: str) -> bool:
    """True when the brackets of ``s`` are balanced (so ``(1)+(2)`` is not taken as a tuple)."""
    depth = 0
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            return False
    return depth == 0


_SYMPY_NAMES = {"sqrt", "pi", "oo", "log", "ln", "sin", "cos", "tan", "exp", "I", "E"}
_LATEX_TO_PY = [
    (r"\\infty", "oo"),
    (r"\\pi", "pi"),
    (r"\\cdot|\\times", "*"),
    (r"\\div", "/"),
    (r"\\ln", "log"),
    (r"\\(log|sin|cos|tan|exp)", r"\1"),
]


def _replace_command(s: str, name: str, arity: int, fmt: Callable[[list[str]], str]) -> str | None:
    """Rewrite ``\\name{a}{b}`` (with nested braces) using ``fmt([a, b])``; None when malformed."""
    while True:
        idx = s.find("\\" + name)
        if idx < 0:
            return s
        pos = idx + len(name) + 1
        args = []
        root = None
        if name == "sqrt" and pos < len(s) and s[pos] == "[":
            close = s.find("]", pos)
            if close < 0:
                return None
            root, pos = s[pos + 1 : close], close + 1
        for _ in range(arity):
            if pos >= len(s) or s[pos] != "{":
                return None
            end = _match_braces(s, pos)
            if end is None:
                return None
            args.append(s[pos + 1 : end])
            pos = end + 1
        if root is not None:
            args.append(root)
        s = s[:idx] + fmt(args) + s[pos:]


def latex_to_sympy_source(s: str) -> str | None:
    """A Python/SymPy source string for a normalised LaTeX answer, or None when unsupported.

    The result uses only numbers, operators, brackets, single-letter symbols and the names in
    ``_SYMPY_NAMES``: nothing else can reach ``parse_expr`` (which evaluates Python).
    """
    s = _replace_command(s, "frac", 2, lambda a: f"(({a[0]})/({a[1]}))")
    if s is None:
        return None
    s = _replace_command(s, "sqrt", 1, lambda a: f"(({a[0]})**(1/({a[1]})))" if len(a) == 2 else f"sqrt({a[0]})")
    if s is None:
        return None
    for pattern, repl in _LATEX_TO_PY:
        s = re.sub(pattern, repl, s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if "\\" in s or "__" in s or not re.fullmatch(r"[\w+\-*/().\s]*", s):
        return None
    for name in re.findall(r"[A-Za-z_]\w*", s):
        if name not in _SYMPY_NAMES and not re.fullmatch(r"[A-Za-z]", name):
            return None
    if _has_huge_power(s):
        return None
    return s


def _has_huge_power(source: str) -> bool:
    """True for exponents that could take forever to evaluate: ``10**10000``, ``10**(10**10)``."""
    if re.search(r"\*\*\s*\(*\s*\d{4,}", source) or source.count("**") > 4:
        return True
    for match in re.finditer(r"\*\*\s*\(", source):
        depth, i = 0, match.end() - 1
        while i < len(source):
            depth += source[i] == "("
            depth -= source[i] == ")"
            if depth == 0:
                break
            i += 1
        if "**" in source[match.end() : i]:
            return True
    return False


def _sympy_equal(pred: str, gt: str) -> bool:
    """SymPy equivalence of two normalised answers (raises on unparsable input)."""
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (*standard_transformations, implicit_multiplication_application)
    sources = [latex_to_sympy_source(x) for x in (pred, gt)]
    if any(src is None or not src.strip() for src in sources):
        raise ValueError("unsupported expression")
    local = {"pi": sympy.pi, "oo": sympy.oo, "I": sympy.I, "E": sympy.E, "log": sympy.log}
    a, b = (parse_expr(src, local_dict=local, transformations=transformations) for src in sources)
    if a == b:
        return True
    if not (a.free_symbols or b.free_symbols):  # constants: compare numerically (fast, no simplify)
        value = complex(sympy.N(a - b, 30))
        scale = max(1.0, abs(complex(sympy.N(b, 30))))
        return abs(value) <= 1e-12 * scale
    return sympy.simplify(a - b) == 0


def _math_verify_equal(pred: str, gt: str) -> bool | None:
    """math-verify's verdict when the package is installed, else None."""
    try:
        import math_verify
    except ImportError:
        return None
    gold = math_verify.parse(f"\\boxed{{{gt}}}")
    answer = math_verify.parse(f"\\boxed{{{pred}}}")
    if not gold or not answer:
        return None
    return bool(math_verify.verify(gold, answer))


def _symbolic_equal(pred: str, gt: str, timeout: float) -> bool:
    """math-verify, else SymPy, under ``timeout``; any failure counts as not equal."""
    if max(len(pred), len(gt)) > MAX_SYMBOLIC_LEN:
        return False
    verdict = call_with_timeout(lambda: _math_verify_equal(pred, gt), timeout)
    if verdict is not None:
        return verdict
    return bool(call_with_timeout(lambda: _sympy_equal(pred, gt), timeout))


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
    ca, cb = _as_collection(a), _as_collection(b)
    if ca is not None or cb is not None:
        if ca is None or cb is None or len(ca[1]) != len(cb[1]):
            return False
        kind_a, kind_b = ca[0], cb[0]
        if {kind_a, kind_b} <= {"list", "()"}:  # a bare list and a tuple are the same thing
            kind_a = kind_b = "()"
        if kind_a != kind_b:
            return False
        if kind_a == "set":
            remaining = list(cb[1])
            for item in ca[1]:
                hit = next((j for j, other in enumerate(remaining) if is_equivalent(item, other, timeout)), None)
                if hit is None:
                    return False
                remaining.pop(hit)
            return True
        return all(is_equivalent(x, y, timeout) for x, y in zip(ca[1], cb[1], strict=True))
    if na is not None and nb is None and re.fullmatch(r"[\d.+-]+", b):
        return False
    return _symbolic_equal(a, b, timeout)


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def _ground_truth_answer(ground_truth: str) -> str:
    """A ground truth may itself be a full solution: take its boxed answer when it has one."""
    boxed = extract_boxed(ground_truth)
    return boxed if boxed is not None else ground_truth


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
