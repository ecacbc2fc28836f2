"""Reward throughput of verl-sat's verifier against verl's ``math_dapo`` scorer, side by side.

    python benchmarks/verifier_throughput.py [--n 4096] [--chars 3000] [--repeats 3] [--in-thread]

What the reward does each step of the paper recipe (docs/reproduce.md: 256 prompts x 16 samples): score
``--n`` responses of about ``--chars`` characters each, 16 per prompt sharing a ground truth, in
one thread: the main thread, or with ``--in-thread`` a worker thread, as verl's reward worker calls
the scorer from its thread pool (there the symbolic checks run in spawned worker processes).
Ground truths are DAPO-style: ``--latex-frac`` of the prompts have a LaTeX answer (fraction,
radical, interval, set, polynomial, complex number, with numbers drawn per prompt), the rest an
integer (all of DAPO-Math-17k's answers are integers). Each response is reasoning filler that
ends with ``Answer: <answer>`` (DAPO's format; a quarter end with ``\\boxed{<answer>}``
instead): correct as written, correct in another form (``0.75`` for ``\\frac{3}{4}``), or
wrong, a third each.

Each pass starts with the verifier's caches cleared (a step's responses are new; only the
ground truths repeat within a group). One burn-in pass on other responses imports and warms
both scorers, then the scorers alternate for ``--repeats`` passes; the median is reported as
responses per second, with the ratio and how often the two agree.

``--latency`` also times single calls that tests/test_verify.py only checks for behaviour:
each costly answer of ``COSTLY`` (its verdict, and the seconds one call takes with
the caches cleared) and how long the timeout takes to give up against its deadline: on stuck
work in the main thread (``call_with_alarm``), and on a slow symbolic check called from a worker
thread (``timed_symbolic_check``, in a spawned process; the first call includes the process's start).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from verl.utils.reward_score import default_compute_score

from verl_sat.eval.verify import (
    _math_verify_parse,
    _symbolic_equal,
    call_with_alarm,
    compute_score,
    normalize_answer,
    timed_symbolic_check,
    verify,
)

# Equal answers whose symbolic check takes SymPy seconds (tests/test_verify.py::SLOW_BUT_EQUAL)
SLOW_BUT_EQUAL = ("(x+1)^{600}(x-1)^{600}", "(x^2-1)^{600}")
# (response, ground truth): answers built to be costly (the cost bounds refuse the first four)
COSTLY = [
    ("\\boxed{10^{10^{10}}}", "1"),
    ("\\boxed{2^{99999}}", "2^{99998}"),
    ("\\boxed{(12345)!}", "1"),
    ("\\boxed{" + "x^2+" * 60 + "1}", "1"),
    ("\\boxed{\\sqrt{\\sqrt{\\sqrt{\\sqrt{\\sqrt{2}}}}}^{32}}", "2"),
    ("\\boxed{" + "\\frac{1}{" * 30 + "2" + "}" * 30 + "}", "2"),
    ("Answer: " + "9" * 5000, "9"),
    ("\\boxed{\\sin(x)^2+\\cos(x)^2}", "1"),
]


def _fraction(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 9), rng.choice((2, 4, 5, 8))
    return f"\\frac{{{a}}}{{{b}}}", str(a / b), f"\\frac{{{b}}}{{{a + b}}}"


def _radical(rng: random.Random) -> tuple[str, str, str]:
    k, m = rng.randint(2, 9), rng.choice((2, 3, 5, 6, 7))
    return f"{k}\\sqrt{{{m}}}", f"\\sqrt{{{k * k * m}}}", f"{k + 1}\\sqrt{{{m}}}"


def _interval(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(-9, 5)
    b = a + rng.randint(1, 9)
    return f"({a}, {b}]", f"\\left({a},{b}\\right]", f"[{a}, {b})"


def _set(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(range(-20, 20), 2)
    return f"\\{{{a}, {b}\\}}", f"\\{{{b}, {a}\\}}", f"\\{{{a}, {b + 1}\\}}"


def _polynomial(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(1, 9)
    return f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2", f"x^2+{a * a}"


def _complex(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"{a} + {b}i", f"{b}i + {a}", f"{a} - {b}i"


def _pi(rng: random.Random) -> tuple[str, str, str]:
    d = rng.randint(2, 12)
    return f"\\frac{{\\pi}}{{{d}}}", f"\\frac{{1}}{{{d}}}\\pi", f"\\frac{{\\pi}}{{{d + 1}}}"


# (ground truth, an equivalent form, a wrong answer), drawn afresh for each prompt
LATEX_ANSWERS: tuple[Callable[[random.Random], tuple[str, str, str]], ...] = (
    _fraction,
    _radical,
    _interval,
    _set,
    _polynomial,
    _complex,
    _pi,
)
WORDS = (
    "Let us consider the sum so that we get a new bound on the value and then we check the case "
    "where the terms cancel which gives the result we wanted since each factor is positive"
).split()
SAMPLES_PER_PROMPT = 16


def filler(rng: random.Random, chars: int) -> str:
    """Reasoning-like text of about ``chars`` characters: words, numbers, inline LaTeX."""
    parts, size = [], 0
    while size < chars:
        roll = rng.random()
        if roll < 0.1:
            part = f"${rng.randint(2, 99)} \\cdot {rng.randint(2, 99)} = {rng.randint(4, 9801)}$"
        elif roll < 0.15:
            part = f"$\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}$"
        elif roll < 0.2:
            part = ".\n\n"
        else:
            part = rng.choice(WORDS)
        parts.append(part)
        size += len(part) + 1
    return " ".join(parts)


def make_batch(n: int, chars: int, latex_frac: float, seed: int) -> list[tuple[str, str]]:
    """``n`` (response, ground truth) pairs, ``SAMPLES_PER_PROMPT`` per prompt."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(max(1, n // SAMPLES_PER_PROMPT)):
        if rng.random() < latex_frac:
            gold, same, wrong = rng.choice(LATEX_ANSWERS)(rng)
        else:
            value = rng.randint(0, 999)
            gold, same, wrong = str(value), f"{value:03d}", str(value + rng.randint(1, 20))
        for _ in range(SAMPLES_PER_PROMPT):
            answer = rng.choice((gold, same, wrong))
            ending = f"\\boxed{{{answer}}}" if rng.random() < 0.25 else f"Answer: {answer}"
            pairs.append((f"{filler(rng, chars)}\n\n{ending}", gold))
    return pairs[:n]


def project(response: str, gold: str) -> float:
    return compute_score("math_dapo", response, gold)


def math_dapo(response: str, gold: str) -> float:
    return float(default_compute_score("math_dapo", response, gold)["score"] > 0)


def one_pass(
    scorer: Callable[[str, str], float], pairs: list[tuple[str, str]], in_thread: bool = False
) -> tuple[float, list[float], int]:
    """Seconds to score every pair (caches cleared first; with ``in_thread`` the worker processes'
    parse caches persist, so ``main`` draws new pairs for each pass), the scores, and how many
    distinct (answer, ground truth) pairs reached the symbolic back-end (verl-sat's scorer only)."""
    for memo in (normalize_answer, _symbolic_equal, _math_verify_parse):
        memo.cache_clear()
    start = time.perf_counter()
    if in_thread:
        with ThreadPoolExecutor(max_workers=1) as pool:
            scores = pool.submit(lambda: [scorer(response, gold) for response, gold in pairs]).result()
    else:
        scores = [scorer(response, gold) for response, gold in pairs]
    return time.perf_counter() - start, scores, _symbolic_equal.cache_info().misses


def latency(deadline_s: float = 0.2) -> None:
    """Seconds per costly answer (caches cleared), and how long a timeout takes to give up."""
    print("single calls (caches cleared before each):")
    for response, gold in COSTLY:
        for memo in (normalize_answer, _symbolic_equal, _math_verify_parse):
            memo.cache_clear()
        start = time.perf_counter()
        verdict = verify(response, gold)
        print(f"  {time.perf_counter() - start:8.3f} s  {verdict!s:<5}  {response[:48]!r}")
    release = threading.Event()

    def stuck() -> None:
        while not release.is_set():
            time.sleep(0.01)

    start = time.perf_counter()
    call_with_alarm(stuck, deadline_s)
    main_s = time.perf_counter() - start
    release.set()
    slow = [normalize_answer(a) for a in SLOW_BUT_EQUAL]
    with ThreadPoolExecutor(max_workers=1) as pool:
        seconds = []
        for _ in range(2):  # the first call starts the worker processes
            began = time.perf_counter()
            pool.submit(timed_symbolic_check, *slow, 1.0).result()
            seconds.append(time.perf_counter() - began)
    print(
        f"call_with_alarm({deadline_s} s) on stuck work returned after {main_s:.3f} s (main thread, SIGALRM); "
        f"a 1 s symbolic check from a worker thread gave up after {seconds[0]:.3f} s (first call), "
        f"{seconds[1]:.3f} s (second)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="responses per pass (the reward's batch)")
    parser.add_argument("--chars", type=int, default=3000, help="characters per response")
    parser.add_argument("--latex-frac", type=float, default=0.2, help="fraction of prompts with a LaTeX answer")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per scorer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", action="store_true", help="also time single costly calls and the timeout")
    parser.add_argument("--in-thread", action="store_true", help="score from a worker thread, as verl's reward does")
    args = parser.parse_args()
    if args.latency:
        latency()

    pairs = make_batch(args.n, args.chars, args.latex_frac, args.seed)
    burn_in = make_batch(min(args.n, 512), args.chars, args.latex_frac, args.seed + 1)
    scorers = {"verl-sat (math-verify)": project, "verl math_dapo": math_dapo}
    for scorer in scorers.values():
        one_pass(scorer, burn_in, args.in_thread)
    times: dict[str, list[float]] = {name: [] for name in scorers}
    scores: dict[str, list[float]] = {}
    symbolic = 0
    for repeat in range(args.repeats):
        if args.in_thread and repeat:  # the worker processes' parse caches persist: new answers each pass
            pairs = make_batch(args.n, args.chars, args.latex_frac, args.seed + 1000 * repeat)
        for name, scorer in scorers.items():
            seconds, scores[name], checks = one_pass(scorer, pairs, args.in_thread)
            times[name].append(seconds)
            symbolic = max(symbolic, checks)
    mean_chars = statistics.mean(len(r) for r, _ in pairs)
    print(
        f"{len(pairs)} responses, {mean_chars:.0f} chars each on average, {SAMPLES_PER_PROMPT} per prompt, "
        f"{args.latex_frac:.0%} LaTeX ground truths; one {'worker' if args.in_thread else 'main'} thread, "
        f"{args.repeats} passes, median; "
        f"python {platform.python_version()} on {platform.machine()}"
    )
    rates = {}
    for name in scorers:
        median = statistics.median(times[name])
        rates[name] = len(pairs) / median
        print(f"  {name:<24} {rates[name]:>9.0f} responses/s  ({median:.2f} s per pass)")
    ours, theirs = rates["verl-sat (math-verify)"], rates["verl math_dapo"]
    agree = sum(a == b for a, b in zip(*scores.values(), strict=True)) / len(pairs)
    accuracy = {name: sum(s) / len(s) for name, s in scores.items()}
    print(f"  ratio math_dapo / verl-sat: {theirs / ours:.1f}x; verdicts agree on {agree:.1%} of responses")
    print("  fraction scored correct: " + ", ".join(f"{name} {acc:.3f}" for name, acc in accuracy.items()))
    print(f"  verl-sat ran {symbolic} distinct symbolic checks (math-verify) per pass; the rest took the fast paths")


if __name__ == "__main__":
    main()
