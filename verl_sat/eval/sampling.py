"""Sample k responses per problem, verify them, and report avg@k / pass@k (docs/reproduce.md).

The backend is any OpenAI-compatible server (vLLM, SGLang, vLLM's CPU build for a small model;
``verl_sat.eval.server``), by URL, ``/v1/completions`` or ``/v1/chat/completions``, through the
``openai`` client: its timeouts, retries and backoff; the evaluation fails fast once a request
fails for good.

``run_eval`` appends each sample to ``samples.jsonl`` as it completes (``verl_sat.eval.store``)
and writes ``summary.json`` (avg@k, pass@k for k = 1, 2, 4, ..., the per-problem table, the
settings) once every sample is drawn; ``resume=True`` draws only the missing ones. Command line:
``python -m verl_sat.eval --help``; docs/eval.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from verl_sat.eval.data import Problem, load_problems
from verl_sat.eval.jobs import DEFAULT_INSTRUCTION, Completion, Job, SamplingConfig, make_jobs
from verl_sat.eval.metrics import avg_at_k, pass_at_k, pass_at_k_per_problem
from verl_sat.eval.server import ContextLengthError, ServerBackend, ServerError
from verl_sat.eval.store import SAMPLES, ResumeRefused, SampleLog, UnfinishedEvaluation, eval_settings
from verl_sat.eval.verify import compute_score, extract_answer
from verl_sat.files import append_jsonl

DEFAULT_DATASET = "HuggingFaceH4/aime_2024"


class EvalIncomplete(RuntimeError):
    """The backend failed for good; the samples drawn so far are kept. One line: what failed, how
    many samples were drawn, where they are, and that ``--resume`` continues."""


def pass_at_k_curve(counts: Sequence[tuple[int, int]], k: int) -> dict[str, float]:
    """pass@j for j = 1, 2, 4, ... up to and including ``k``."""
    js = sorted({2**p for p in range(k.bit_length()) if 2**p <= k} | {k})
    return {str(j): pass_at_k(counts, j) for j in js}


def summarize(problems: Sequence[Problem], records: Sequence[Mapping[str, Any]], k: int) -> dict[str, Any]:
    """avg@k, pass@k and the per-problem table from per-sample records."""
    by_problem: dict[str, list[Mapping[str, Any]]] = {p.id: [] for p in problems}
    for record in records:
        by_problem[record["problem_id"]].append(record)
    table, counts = [], []
    for problem in problems:
        rows = by_problem[problem.id]
        n, c = len(rows), sum(bool(r["correct"]) for r in rows)
        if n == 0:
            raise ValueError(f"problem {problem.id!r} has no samples")
        counts.append((n, c))
        table.append(
            {
                "problem_id": problem.id,
                "answer": problem.answer,
                "n": n,
                "correct": c,
                "accuracy": c / n,
                f"pass@{k}": pass_at_k_per_problem(n, c, min(k, n)),
                "truncated": sum(r.get("finish_reason") == "length" for r in rows),
            }
        )
    n_samples = sum(n for n, _ in counts)
    return {
        "n_problems": len(problems),
        "k": k,
        f"avg@{k}": avg_at_k(counts),
        f"pass@{k}": pass_at_k(counts, min(k, min(n for n, _ in counts))),
        "pass@k_curve": pass_at_k_curve(counts, min(n for n, _ in counts)),
        "truncated_frac": sum(row["truncated"] for row in table) / n_samples,
        "per_problem": table,
    }


def format_table(summary: Mapping[str, Any]) -> str:
    """The per-problem table and the headline numbers as Markdown."""
    k = summary["k"]
    lines = ["| problem | answer | correct | accuracy |", "|---|---|---|---|"]
    for row in summary["per_problem"]:
        lines.append(f"| {row['problem_id']} | {row['answer']} | {row['correct']}/{row['n']} | {row['accuracy']:.3f} |")
    lines.append("")
    lines.append(f"avg@{k} = {100 * summary[f'avg@{k}']:.2f}%   pass@{k} = {100 * summary[f'pass@{k}']:.2f}%")
    return "\n".join(lines)


def score_sample(problem: Problem, job: Job, completion: Completion, dataset: str) -> dict[str, Any]:
    """One ``samples.jsonl`` record, scored by ``compute_score`` (the training reward)."""
    return {
        "problem_id": problem.id,
        "sample_index": job.sample_index,
        "seed": job.seed,
        "response": completion.text,
        "extracted_answer": extract_answer(completion.text),
        "ground_truth": problem.answer,
        "correct": compute_score(dataset, completion.text, problem.answer) == 1.0,
        "finish_reason": completion.finish_reason,
    }


def run_eval(
    problems: Sequence[Problem],
    backend: ServerBackend,
    cfg: SamplingConfig,
    out_dir: str | Path,
    instruction: str = DEFAULT_INSTRUCTION,
    dataset: str = "aime24",
    progress: bool = True,
    source: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Sample ``cfg.k`` responses per problem, verify them, write ``samples.jsonl`` and ``summary.json``.

    Each sample is scored by ``compute_score``, the function the paper recipe trains and validates
    with (``reward.custom_reward_function``), in the calling thread, and appended to
    ``out_dir/samples.jsonl`` at once (``verl_sat.eval.store``). ``summary.json`` is written only
    once every (problem, sample) pair is drawn. With ``resume``, the samples already in
    ``out_dir`` are checked against this run's settings and only the missing pairs are drawn.

    Returns the summary dict (also written to ``out_dir/summary.json``).

    Raises:
        EvalIncomplete: the backend failed for good (``ServerError``); the message says how many
            samples were drawn and kept.
        ResumeRefused: ``resume`` and the kept samples were drawn with other settings.
        UnfinishedEvaluation: not ``resume``, and ``out_dir`` holds an unfinished evaluation.
    """
    log = SampleLog(out_dir)
    settings = eval_settings(problems, cfg, instruction, backend.identity())
    kept = log.open(settings, resume, problems, cfg)
    records = list(kept.values())
    jobs = make_jobs(problems, cfg, instruction, skip=frozenset(kept))
    total = len(problems) * cfg.k
    n_correct = sum(bool(r["correct"]) for r in records)
    bar = tqdm(total=total, initial=len(records), desc=f"{dataset} k={cfg.k}", file=sys.stderr, disable=not progress)
    started = time.time()
    samples = backend.generate(jobs, cfg) if jobs else iter(())
    try:
        for job, completion in samples:
            record = score_sample(problems[job.problem_index], job, completion, dataset)
            log.append(record)
            records.append(record)
            n_correct += record["correct"]
            bar.update(1)
            bar.set_postfix(acc=f"{n_correct / len(records):.3f}", refresh=False)
    except ServerError as exc:
        then = (
            "--resume continues with the same --max-tokens once the server's context is longer"
            if isinstance(exc, ContextLengthError)
            else "rerun with --resume to draw only the missing ones"
        )
        drawn = f"{len(records)} of {total} samples drawn ({len(records) - len(kept)} in this run)"
        raise EvalIncomplete(f"{exc}; {drawn}, kept in {log.path}: {then}") from exc
    finally:
        getattr(samples, "close", lambda: None)()  # a generator's requests in flight are cancelled
        bar.close()
    order = {p.id: i for i, p in enumerate(problems)}
    records.sort(key=lambda r: (order[r["problem_id"]], r["sample_index"]))
    summary = {"dataset": dataset, "source": source, **summarize(problems, records, cfg.k)}
    summary["sampling"] = asdict(cfg)
    summary["backend"] = backend.describe()
    summary["instruction"] = instruction
    summary["wall_s"] = round(time.time() - started, 3)
    summary["resumed_from"] = len(kept) if resume else None
    log.finish(records, summary)
    return summary


def append_metrics(path: str | Path, step: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """Append ``{"step", "eval/<dataset>/avg@k", "eval/<dataset>/pass@k"}`` to a run's metrics.jsonl."""
    k, dataset = summary["k"], summary["dataset"]
    line = {
        "step": int(step),
        f"eval/{dataset}/avg@{k}": summary[f"avg@{k}"],
        f"eval/{dataset}/pass@{k}": summary[f"pass@{k}"],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(Path(path), [line])
    return line


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m verl_sat.eval`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m verl_sat.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", metavar="URL", required=True, help="OpenAI-compatible server: http://HOST:PORT")
    p.add_argument("--data", default=DEFAULT_DATASET, help="JSONL/JSON/parquet path or hub dataset id")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems")
    p.add_argument("--name", default="aime24", help="dataset name used in outputs and metric keys")
    p.add_argument("--out", required=True, help="output directory (samples.jsonl, eval_config.json, summary.json)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the evaluation in --out: check its settings, draw only the missing samples",
    )
    p.add_argument("--k", type=int, default=16, help="samples per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=SamplingConfig.max_tokens,
        help="most new tokens per response (default: training's 30720, so prompt + response fit a 32768 context)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; -1 = unseeded")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions", help="endpoint")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for the completions chat template")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument(
        "--max-retries",
        type=int,
        default=5,
        help="retries per request (connection errors, timeouts, 408/409/429, 5xx), by the openai client",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds per request (default: 60 + max_tokens / 10, a whole generation at 10 tokens/s)",
    )
    p.add_argument("--log-to", default=None, help="also append eval/<name>/avg@k to this metrics.jsonl")
    p.add_argument("--step", type=int, default=None, help="training step for --log-to")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def kept_count(out_dir: str | Path) -> int:
    """Samples in ``out_dir/samples.jsonl`` (complete lines)."""
    path = Path(out_dir) / SAMPLES
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point of ``python -m verl_sat.eval``; returns the summary.

    A failure that leaves samples behind (a dead server, a refused ``--resume``, Ctrl-C) exits
    non-zero with one line on stderr, prefixed ``verl_sat.eval:``.
    """
    args = build_parser().parse_args(argv)
    if args.log_to and args.step is None:
        raise SystemExit("--log-to needs --step (the training step of the evaluated checkpoint)")
    cfg = SamplingConfig(
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=None if args.seed == -1 else args.seed,
    )
    problems = load_problems(args.data, limit=args.limit)
    try:
        backend = ServerBackend(
            args.server,
            model=args.model,
            api=args.api,
            tokenizer=args.tokenizer,
            concurrency=args.concurrency,
            max_retries=args.max_retries,
            timeout_s=args.request_timeout,
        )
        summary = run_eval(
            problems,
            backend,
            cfg,
            args.out,
            args.instruction,
            args.name,
            progress=not args.quiet,
            source=args.data,
            resume=args.resume,
        )
    except (EvalIncomplete, ServerError, ResumeRefused, UnfinishedEvaluation) as exc:
        raise SystemExit(f"verl_sat.eval: {exc}") from None
    except KeyboardInterrupt:
        print(
            f"verl_sat.eval: interrupted; {kept_count(args.out)} samples kept in {Path(args.out) / SAMPLES}: "
            "rerun with --resume to draw only the missing ones",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    print(format_table(summary))
    if args.log_to:
        append_metrics(args.log_to, args.step, summary)
    return summary
