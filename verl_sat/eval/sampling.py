"""Sample k responses per problem, verify them, and report avg@k / pass@k (docs/reproduce.md).

Two backends:

- ``ServerBackend`` (``verl_sat.eval.server``): an OpenAI-compatible server (vLLM, SGLang, ...)
  by URL, ``/v1/completions`` or ``/v1/chat/completions``; one request per sample, retried with
  backoff and jitter on connection errors, timeouts, 429 and 5xx, failing fast once a request
  fails for good. Standard library only.
- ``HFBackend``: a local Hugging Face checkpoint directory, ``transformers`` ``generate`` on CPU
  (or any torch device), batched, left-padded; each sample draws from its own seeded generator,
  so a sample does not depend on the batch it was drawn in.

``run_eval`` appends each sample to ``samples.jsonl`` as it completes (``verl_sat.eval.store``)
and writes ``summary.json`` (avg@k, pass@k for k = 1, 2, 4, ..., the per-problem table, the
settings) once every sample is drawn; ``resume=True`` draws only the missing ones. Command line:
``python -m verl_sat.eval --help``; docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_sat.eval.data import Problem, load_problems
from verl_sat.eval.jobs import (
    DEFAULT_INSTRUCTION,
    Backend,
    Completion,
    Job,
    SamplingConfig,
    build_messages,
    make_jobs,
    render_prompt,
)
from verl_sat.eval.metrics import avg_at_k, pass_at_k, pass_at_k_per_problem
from verl_sat.eval.server import RETRYABLE_HTTP, ContextLengthError, RetryPolicy, ServerBackend, ServerError, api_base
from verl_sat.eval.store import SAMPLES, ResumeRefused, SampleLog, UnfinishedEvaluation, eval_settings
from verl_sat.eval.verify import compute_score, extract_answer

DEFAULT_DATASET = "HuggingFaceH4/aime_2024"

__all__ = [
    "DEFAULT_INSTRUCTION",
    "RETRYABLE_HTTP",
    "Backend",
    "Completion",
    "ContextLengthError",
    "EvalIncomplete",
    "HFBackend",
    "Job",
    "ResumeRefused",
    "RetryPolicy",
    "SamplingConfig",
    "ServerBackend",
    "ServerError",
    "UnfinishedEvaluation",
    "api_base",
    "append_metrics",
    "build_messages",
    "main",
    "make_jobs",
    "render_prompt",
    "run_eval",
]


class EvalIncomplete(RuntimeError):
    """The backend failed for good; the samples drawn so far are kept. One line: what failed, how
    many samples were drawn, where they are, and that ``--resume`` continues."""


# ---------------------------------------------------------------------------------------------
# Local Hugging Face checkpoint
# ---------------------------------------------------------------------------------------------


class HFBackend:
    """A local HF checkpoint directory sampled with ``transformers`` ``generate`` (batched, left-padded).

    A seeded sample draws its tokens from its own ``torch.Generator`` seeded with the job's seed
    (``per_sample_sampler``), so it is the same whichever batch it lands in: a resumed evaluation
    equals an uninterrupted one (up to the floating-point effect of different padding on the
    logits). Unseeded (``--seed -1``) runs sample with torch's global generator.

    Args:
        model_path: directory with the config, weights and tokenizer (nothing is downloaded).
        batch_size: sequences per ``generate`` call.
        device: torch device (default ``"cpu"``).
        dtype: torch dtype name (default ``"float32"``; CPUs are slow or inexact in half precision).
    """

    def __init__(self, model_path: str | Path, batch_size: int = 8, device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"not a Hugging Face checkpoint directory (no config.json): {path}")
        if batch_size < 1:
            raise ValueError(f"hf.batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.device, self.dtype = path, batch_size, device, dtype
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=getattr(torch, dtype))
        self.model.to(device).eval()

    def describe(self) -> dict[str, Any]:
        return {"backend": "hf", "model_path": str(self.path), "device": self.device, "batch_size": self.batch_size}

    def identity(self) -> dict[str, Any]:
        """What a resumed evaluation must share with this one (batch size and device may change)."""
        return {"backend": "hf", "model": str(self.path.resolve()), "dtype": self.dtype}

    def _generation_kwargs(self, cfg: SamplingConfig, seeds: Sequence[int | None]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": cfg.max_tokens, "pad_token_id": self.tokenizer.pad_token_id}
        if cfg.temperature == 0:
            return {**kwargs, "do_sample": False}
        if all(seed is not None for seed in seeds):
            # greedy over logits that the sampler has reduced to the one token it drew per row
            return {**kwargs, "do_sample": False, "logits_processor": [per_sample_sampler(seeds, cfg)]}
        # HF's default top_k is 50; the paper samples the full support (top_k = -1 -> 0 here).
        top_k = 0 if cfg.top_k == -1 else cfg.top_k
        return {**kwargs, "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": top_k}

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        import torch

        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        eos_ids = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        for start in range(0, len(jobs), self.batch_size):
            batch = list(jobs[start : start + self.batch_size])
            prompts = [render_prompt(job.messages, self.tokenizer) for job in batch]
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_template)
            enc = {name: tensor.to(self.device) for name, tensor in enc.items()}
            with torch.no_grad():
                out = self.model.generate(**enc, **self._generation_kwargs(cfg, [job.seed for job in batch]))
            new_tokens = out[:, enc["input_ids"].shape[1] :]  # (B, T_new)
            for job, tokens in zip(batch, new_tokens, strict=True):
                ids = tokens.tolist()
                stopped = any(t in eos_ids for t in ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                yield job, Completion(text, "stop" if stopped or len(ids) < cfg.max_tokens else "length")


def per_sample_sampler(seeds: Sequence[int], cfg: SamplingConfig) -> Any:
    """A ``transformers`` logits processor that samples row ``r`` with its own generator seeded
    ``seeds[r]`` (temperature, then top-k, then top-p, as HF orders its warpers) and leaves only
    the drawn token finite, so that greedy decoding emits it. Row ``r``'s t-th token uses its
    generator's t-th draw, whatever the other rows do."""
    import torch
    from transformers import LogitsProcessor

    class PerSampleSampler(LogitsProcessor):
        def __init__(self) -> None:
            self.generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            logits = scores.float() / cfg.temperature  # (B, V)
            if cfg.top_k != -1 and cfg.top_k < logits.shape[-1]:
                kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if cfg.top_p < 1.0:
                probs_sorted, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
                before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass of the tokens ranked above
                drop_sorted = before >= cfg.top_p  # HF keeps the smallest set with mass >= top_p
                logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
            probs = torch.softmax(logits, dim=-1).cpu()
            picks = torch.stack(
                [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators, strict=True)]
            )
            out = torch.full_like(scores, float("-inf"))
            return out.scatter(-1, picks.to(scores.device), 0.0)

    return PerSampleSampler()


# ---------------------------------------------------------------------------------------------
# Progress, scoring, outputs
# ---------------------------------------------------------------------------------------------


class Progress:
    """tqdm when installed, else a counter printed to stderr about every 5%."""

    def __init__(self, total: int, desc: str = "sampling", enabled: bool = True, initial: int = 0) -> None:
        self.total, self.count, self.desc, self.enabled = total, initial, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, initial=initial)
            except ImportError:
                self._bar = None
        self._every = max(1, total // 20)

    def update(self, correct_so_far: int) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(acc=f"{correct_so_far / self.count:.3f}", refresh=False)
        elif self.count % self._every == 0 or self.count == self.total:
            print(f"{self.desc}: {self.count}/{self.total} acc={correct_so_far / self.count:.3f}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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


def identity_of(backend: Backend) -> dict[str, Any]:
    """``backend.identity()`` when it has one (the model a resumed evaluation must share), else its kind."""
    identity = getattr(backend, "identity", None)
    return dict(identity()) if callable(identity) else {"backend": backend.describe().get("backend")}


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
    backend: Backend,
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
    settings = eval_settings(problems, cfg, instruction, identity_of(backend))
    kept = log.open(settings, resume, problems, cfg)
    records = list(kept.values())
    jobs = make_jobs(problems, cfg, instruction, skip=frozenset(kept))
    total = len(problems) * cfg.k
    n_correct = sum(bool(r["correct"]) for r in records)
    bar = Progress(total, desc=f"{dataset} k={cfg.k}", enabled=progress, initial=len(records))
    started = time.time()
    try:
        for job, completion in backend.generate(jobs, cfg) if jobs else ():
            record = score_sample(problems[job.problem_index], job, completion, dataset)
            log.append(record)
            records.append(record)
            n_correct += record["correct"]
            bar.update(n_correct)
    except ServerError as exc:
        then = (
            "--resume continues with the same --max-tokens once the server's context is longer"
            if isinstance(exc, ContextLengthError)
            else "rerun with --resume to draw only the missing ones"
        )
        drawn = f"{len(records)} of {total} samples drawn ({len(records) - len(kept)} in this run)"
        raise EvalIncomplete(f"{exc}; {drawn}, kept in {log.path}: {then}") from exc
    finally:
        bar.close()
        log.close()
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
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
    return line


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m verl_sat.eval`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m verl_sat.eval", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    src.add_argument("--hf", metavar="DIR", help="local Hugging Face checkpoint directory")
    p.add_argument("--data", default=DEFAULT_DATASET, help="JSONL/JSON/parquet path or hub dataset id")
    p.add_argument("--split", default="train", help="hub split")
    p.add_argument("--subset", default=None, help="hub configuration name")
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
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0, help="base seed; -1 = unseeded")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question")
    p.add_argument("--model", default=None, help="[server] model name (default: first of /v1/models)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions", help="[server] endpoint")
    p.add_argument("--tokenizer", default=None, help="[server] tokenizer dir for the completions chat template")
    p.add_argument("--concurrency", type=int, default=16, help="[server] requests in flight")
    p.add_argument(
        "--max-retries",
        type=int,
        default=5,
        help="[server] retries per request (connection errors, 408/409/425/429, 5xx)",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="[server] first retry delay in s, doubled each retry (<= 60 s, jittered)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="[server] seconds per request (default: 60 + max_tokens / 10, a whole generation at 10 tokens/s)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="[hf] sequences per generate call")
    p.add_argument("--device", default="cpu", help="[hf] torch device")
    p.add_argument("--dtype", default="float32", help="[hf] torch dtype")
    p.add_argument("--log-to", default=None, help="also append eval/<name>/avg@k to this metrics.jsonl")
    p.add_argument("--step", type=int, default=None, help="training step for --log-to")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def make_backend(args: argparse.Namespace) -> Backend:
    """The backend the command line asks for."""
    if args.server:
        return ServerBackend(
            args.server,
            model=args.model,
            api=args.api,
            tokenizer=args.tokenizer,
            concurrency=args.concurrency,
            max_retries=args.max_retries,
            backoff_s=args.backoff,
            timeout_s=args.request_timeout,
        )
    return HFBackend(args.hf, batch_size=args.batch_size, device=args.device, dtype=args.dtype)


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
    problems = load_problems(args.data, split=args.split, subset=args.subset, limit=args.limit)
    try:
        backend = make_backend(args)
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
