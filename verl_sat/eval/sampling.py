"""Sample k responses per problem, verify them, and report avg@k / pass@k (SPEC §7).

Two backends:

- ``ServerBackend``: an OpenAI-compatible server (vLLM, SGLang, ...) by URL, ``/v1/completions``
  or ``/v1/chat/completions``; one request per sample from a thread pool, retried with
  exponential backoff on connection errors, timeouts, 429 and 5xx. Standard library only.
- ``HFBackend``: a local Hugging Face checkpoint directory, ``transformers`` ``generate`` on CPU
  (or any torch device), batched, left-padded.

``run_eval`` writes ``samples.jsonl`` (one line per sample) and ``summary.json`` (avg@k,
pass@k for k = 1, 2, 4, ..., the per-problem table, the settings). Command line:
``python -m verl_sat.eval --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from verl_sat.eval.data import Problem, load_problems
from verl_sat.eval.metrics import avg_at_k, pass_at_k, pass_at_k_per_problem
from verl_sat.eval.verify import compute_score, extract_answer

DEFAULT_INSTRUCTION = (
    "Please reason step by step, and put your final answer within \\boxed{}. "
    "The last line of your response should be of the form Answer: <answer>."
)
DEFAULT_DATASET = "HuggingFaceH4/aime_2024"
RETRYABLE_HTTP = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings (defaults: the paper's evaluation, SPEC §7).

    Args:
        k: samples per problem (paper: 16).
        temperature: sampling temperature (paper: 1.0); 0 means greedy.
        top_p: nucleus mass in (0, 1] (paper: 1.0).
        top_k: top-k cut-off, -1 for none (paper: -1).
        max_tokens: most new tokens per response (paper: 32768).
        seed: base seed; sample ``j`` of problem ``i`` uses ``seed + i * k + j`` (None: unseeded).
    """

    k: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 32768
    seed: int | None = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"sampling.k must be >= 1, got {self.k}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Job:
    """One sample to draw: problem ``problem_index`` (in load order), sample ``sample_index``."""

    problem_index: int
    sample_index: int
    messages: tuple[Mapping[str, str], ...]
    seed: int | None


@dataclass(frozen=True)
class Completion:
    """A generated response; ``finish_reason`` is ``"stop"`` or ``"length"`` (truncated)."""

    text: str
    finish_reason: str


class Backend(Protocol):
    """Draws completions; yields each job with its completion, in any order."""

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]: ...

    def describe(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def build_messages(problem: Problem, instruction: str = DEFAULT_INSTRUCTION) -> tuple[dict[str, str], ...]:
    """Chat messages for a problem: verl rows keep their own messages, others get question + instruction."""
    if problem.messages is not None:
        return tuple(dict(m) for m in problem.messages)
    content = f"{problem.question}\n\n{instruction}" if instruction else problem.question
    return ({"role": "user", "content": content},)


def render_prompt(messages: Sequence[Mapping[str, str]], tokenizer: Any | None = None) -> str:
    """Prompt text: the tokenizer's chat template when it has one, else the message contents joined."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def make_jobs(problems: Sequence[Problem], cfg: SamplingConfig, instruction: str = DEFAULT_INSTRUCTION) -> list[Job]:
    """``k`` jobs per problem, each with its own seed (so seeded servers do not repeat a sample)."""
    jobs = []
    for i, problem in enumerate(problems):
        messages = build_messages(problem, instruction)
        for j in range(cfg.k):
            seed = None if cfg.seed is None else cfg.seed + i * cfg.k + j
            jobs.append(Job(i, j, messages, seed))
    return jobs


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible server
# ---------------------------------------------------------------------------------------------


class ServerError(RuntimeError):
    """A request failed for good (a non-retryable status, or retries exhausted)."""


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1[/]`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


class ServerBackend:
    """An OpenAI-compatible ``/v1/completions`` or ``/v1/chat/completions`` endpoint.

    Args:
        url: server address (``http://127.0.0.1:8000`` or ``.../v1``).
        model: model name for the request; None asks ``GET /v1/models`` for the first one.
        api: ``"completions"`` (prompt rendered here, with ``tokenizer``'s chat template if given)
            or ``"chat"`` (the server applies its template).
        tokenizer: a tokenizer (or a path to one) for rendering completions prompts.
        concurrency: requests in flight.
        max_retries: retries per request after the first try.
        backoff_s: the first retry waits this long, then 2x, 4x, ... (capped at 60 s).
        timeout_s: per-request timeout.
        api_key: sent as ``Authorization: Bearer``; None reads ``OPENAI_API_KEY`` if set.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api: str = "completions",
        tokenizer: Any | None = None,
        concurrency: int = 8,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        timeout_s: float = 3600.0,
        api_key: str | None = None,
    ) -> None:
        if api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
        if concurrency < 1 or max_retries < 0:
            raise ValueError(f"need concurrency >= 1 and max_retries >= 0, got {concurrency}, {max_retries}")
        self.base = api_base(url)
        self.api = api
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.model = model or self._first_model()
        self.retries_used = 0

    def describe(self) -> dict[str, Any]:
        return {"backend": "server", "url": self.base, "api": self.api, "model": self.model}

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request(self, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        """One HTTP call with retries; returns the decoded JSON body."""
        url = f"{self.base}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries_used += 1
                time.sleep(min(60.0, self.backoff_s * 2 ** (attempt - 1)))
            request = urllib.request.Request(
                url, data=data, headers=self._headers(), method="GET" if data is None else "POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                body = exc.read().decode("utf-8", "replace")[:300]
                if exc.code not in RETRYABLE_HTTP:
                    raise ServerError(f"{url}: HTTP {exc.code}: {body}") from exc
                last_error = f"HTTP {exc.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
        raise ServerError(f"{url}: failed after {self.max_retries + 1} tries; last error {last_error}")

    def _first_model(self) -> str:
        models = self._request("/models", None).get("data") or []
        if not models:
            raise ServerError(f"{self.base}/models lists no model; pass the model name explicitly")
        return str(models[0]["id"])

    def _payload(self, job: Job, cfg: SamplingConfig) -> tuple[str, dict[str, Any]]:
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "n": 1,
        }
        if cfg.top_k != -1:
            payload["top_k"] = cfg.top_k  # a vLLM / SGLang extension; plain OpenAI rejects it
        if job.seed is not None:
            payload["seed"] = job.seed
        if self.api == "chat":
            payload["messages"] = [dict(m) for m in job.messages]
            return "/chat/completions", payload
        payload["prompt"] = render_prompt(job.messages, self.tokenizer)
        return "/completions", payload

    def complete(self, job: Job, cfg: SamplingConfig) -> Completion:
        """One sample for one job."""
        path, payload = self._payload(job, cfg)
        body = self._request(path, payload)
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"{self.base}{path}: unexpected response {str(body)[:300]}") from exc
        return Completion(text or "", "length" if choice.get("finish_reason") == "length" else "stop")

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = {pool.submit(self.complete, job, cfg): job for job in jobs}
            for future in as_completed(futures):
                yield futures[future], future.result()


# ---------------------------------------------------------------------------------------------
# Local Hugging Face checkpoint
# ---------------------------------------------------------------------------------------------


class HFBackend:
    """A local HF checkpoint directory sampled with ``transformers`` ``generate`` (batched, left-padded).

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
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.device = path, batch_size, device
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=getattr(torch, dtype))
        self.model.to(device).eval()

    def describe(self) -> dict[str, Any]:
        return {"backend": "hf", "model_path": str(self.path), "device": self.device, "batch_size": self.batch_size}

    def _generation_kwargs(self, cfg: SamplingConfig) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": cfg.max_tokens,
            "pad_token_id": self.tokenizer.pad_token_id,
            "do_sample": cfg.temperature > 0,
        }
        if cfg.temperature > 0:
            # HF's default top_k is 50; the paper samples the full support (top_k = -1 -> 0 here).
            kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0 if cfg.top_k == -1 else cfg.top_k)
        return kwargs

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        import torch

        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        eos_ids = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        for start in range(0, len(jobs), self.batch_size):
            batch = list(jobs[start : start + self.batch_size])
            prompts = [render_prompt(job.messages, self.tokenizer) for job in batch]
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not has_template)
            enc = {name: tensor.to(self.device) for name, tensor in enc.items()}
            if batch[0].seed is not None:
                torch.manual_seed(batch[0].seed)
            with torch.no_grad():
                out = self.model.generate(**enc, **self._generation_kwargs(cfg))
            new_tokens = out[:, enc["input_ids"].shape[1] :]  # (B, T_new)
            for job, tokens in zip(batch, new_tokens, strict=True):
                ids = tokens.tolist()
                stopped = any(t in eos_ids for t in ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                yield job, Completion(text, "stop" if stopped or len(ids) < cfg.max_tokens else "length")


# ---------------------------------------------------------------------------------------------
# Progress, scoring, outputs
# ---------------------------------------------------------------------------------------------


class Progress:
    """tqdm when installed, else a counter printed to stderr about every 5%."""

    def __init__(self, total: int, desc: str = "sampling", enabled: bool = True) -> None:
        self.total, self.count, self.desc, self.enabled = total, 0, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)
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


def run_eval(
    problems: Sequence[Problem],
    backend: Backend,
    cfg: SamplingConfig,
    out_dir: str | Path,
    instruction: str = DEFAULT_INSTRUCTION,
    dataset: str = "aime24",
    progress: bool = True,
    source: str | None = None,
) -> dict[str, Any]:
    """Sample ``cfg.k`` responses per problem, verify them, write ``samples.jsonl`` and ``summary.json``.

    Each sample is scored by ``compute_score``, the function the paper recipe trains and validates
    with (``reward.custom_reward_function``), in the calling thread.
    Returns the summary dict (also written to ``out_dir/summary.json``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(problems, cfg, instruction)
    records: list[dict[str, Any]] = []
    bar = Progress(len(jobs), desc=f"{dataset} k={cfg.k}", enabled=progress)
    n_correct = 0
    started = time.time()
    try:
        for job, completion in backend.generate(jobs, cfg):
            problem = problems[job.problem_index]
            correct = compute_score(dataset, completion.text, problem.answer) == 1.0  # the training reward
            n_correct += correct
            records.append(
                {
                    "problem_id": problem.id,
                    "sample_index": job.sample_index,
                    "response": completion.text,
                    "extracted_answer": extract_answer(completion.text),
                    "ground_truth": problem.answer,
                    "correct": correct,
                    "finish_reason": completion.finish_reason,
                }
            )
            bar.update(n_correct)
    finally:
        bar.close()
    order = {p.id: i for i, p in enumerate(problems)}
    records.sort(key=lambda r: (order[r["problem_id"]], r["sample_index"]))
    with (out / "samples.jsonl").open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary = {"dataset": dataset, "source": source, **summarize(problems, records, cfg.k)}
    summary["sampling"] = asdict(cfg)
    summary["backend"] = backend.describe()
    summary["instruction"] = instruction
    summary["wall_s"] = round(time.time() - started, 3)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
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
    p.add_argument("--out", required=True, help="output directory (samples.jsonl, summary.json)")
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
    p.add_argument("--max-retries", type=int, default=5, help="[server] retries per request")
    p.add_argument("--backoff", type=float, default=1.0, help="[server] first retry delay, doubled each retry")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="[server] seconds per request")
    p.add_argument("--batch-size", type=int, default=8, help="[hf] sequences per generate call")
    p.add_argument("--device", default="cpu", help="[hf] torch device")
    p.add_argument("--dtype", default="float32", help="[hf] torch dtype")
    p.add_argument("--log-to", default=None, help="also append eval/<name>/avg@k to this metrics.jsonl")
    p.add_argument("--step", type=int, default=None, help="training step for --log-to")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point of ``python -m verl_sat.eval``; returns the summary."""
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
    backend: Backend
    if args.server:
        backend = ServerBackend(
            args.server,
            model=args.model,
            api=args.api,
            tokenizer=args.tokenizer,
            concurrency=args.concurrency,
            max_retries=args.max_retries,
            backoff_s=args.backoff,
            timeout_s=args.request_timeout,
        )
    else:
        backend = HFBackend(args.hf, batch_size=args.batch_size, device=args.device, dtype=args.dtype)
    summary = run_eval(
        problems, backend, cfg, args.out, args.instruction, args.name, progress=not args.quiet, source=args.data
    )
    print(format_table(summary))
    if args.log_to:
        append_metrics(args.log_to, args.step, summary)
    return summary
