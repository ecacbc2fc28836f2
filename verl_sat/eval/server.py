"""An OpenAI-compatible server (vLLM, SGLang, ...) as an evaluation backend, standard library only.

One request per sample (``/v1/completions`` or ``/v1/chat/completions``), ``concurrency`` in
flight from daemon worker threads. What a request survives and what ends the evaluation:

- **Retried** with exponential backoff and jitter (``RetryPolicy``): connection errors (refused,
  reset, a server that died mid-answer), timeouts, unreadable bodies, HTTP 408/409/425/429 and
  every 5xx; a ``Retry-After`` header is honoured up to the backoff cap.
- **Fatal**: retries exhausted, or any other status (400, 401, 404, ...). A 400 that says the
  prompt plus ``max_tokens`` exceeds the model's context (vLLM: "maximum context length") becomes
  a ``ContextLengthError`` naming the problem, the numbers and what to change.
- **Fail fast**: after a fatal error no further request is sent (the queued ones are cancelled),
  requests waiting in a backoff stop at once, and requests still waiting on the server get at
  most ``RetryPolicy.grace_s`` (the last backoff step, 16 s by default) to finish; what finishes in time is
  handed back with the rest, then the error is raised. The workers are daemon threads, so a
  request stuck in a socket never holds the process.

The per-request timeout defaults to ``60 s + max_tokens / 10 tokens/s`` (3337 s at 32k tokens):
a non-streamed completion sends nothing until its last token, so the timeout must cover a whole
generation. docs/eval.md lists the flags.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_sat.eval.jobs import Completion, Job, SamplingConfig, render_prompt

RETRYABLE_HTTP = frozenset({408, 409, 425, 429})  # and every 5xx
MIN_TOKENS_PER_S = 10.0  # the slowest per-sequence decode speed the default timeout allows for
TIMEOUT_FLOOR_S = 60.0
MODELS_TIMEOUT_S = 60.0
_CONTEXT_RE = re.compile(r"(?:maximum context length (?:is |\()|max_model_len=(?:max_total_tokens=)?)(\d+)", re.I)
_PROMPT_RES = (
    re.compile(r"prompt contains (?:at least )?(\d+) input tokens", re.IGNORECASE),  # vLLM 0.28 (renderers/params.py)
    re.compile(r"request has (\d+) input tokens", re.IGNORECASE),  # older vLLM releases
    re.compile(r"(\d+) in the messages", re.IGNORECASE),  # older vLLM releases
    re.compile(r"input length \((\d+)\)", re.IGNORECASE),  # vLLM 0.28 (get_max_tokens)
)


def is_retryable_status(code: int) -> bool:
    """Whether an HTTP status is worth retrying: 408, 409, 425, 429 and every 5xx."""
    return code in RETRYABLE_HTTP or 500 <= code <= 599


def default_timeout_s(max_tokens: int) -> float:
    """A per-request timeout that fits a whole non-streamed generation of ``max_tokens`` tokens."""
    return TIMEOUT_FLOOR_S + max_tokens / MIN_TOKENS_PER_S


@dataclass(frozen=True)
class RetryPolicy:
    """How a request is retried.

    Args:
        max_retries: retries after the first try (``--max-retries``).
        backoff_s: the first retry waits about this long, then twice as long each time (``--backoff``).
        backoff_cap_s: no single wait is longer.
        jitter: each wait is drawn uniformly from ``[(1 - jitter) * d, d]``, so that the requests
            that failed together do not come back together.
    """

    max_retries: int = 5
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"server.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0 or self.backoff_cap_s < 0:
            raise ValueError(
                f"server.backoff_s and backoff_cap_s must be >= 0, got {self.backoff_s}, {self.backoff_cap_s}"
            )
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"server.jitter must be in [0, 1], got {self.jitter}")

    def max_delay_s(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1-based)."""
        return min(self.backoff_cap_s, self.backoff_s * 2 ** (retry - 1))

    def delay_s(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number ``retry``, jittered."""
        return self.max_delay_s(retry) * (1.0 - self.jitter * rng.random())

    @property
    def budget_s(self) -> float:
        """The longest a request spends waiting between its tries (the sum of the waits)."""
        return sum(self.max_delay_s(r) for r in range(1, self.max_retries + 1))

    @property
    def grace_s(self) -> float:
        """How long requests still waiting on the server get after a fatal error: the last backoff step."""
        return self.max_delay_s(max(1, self.max_retries))


class ServerError(RuntimeError):
    """A request failed for good: a non-retryable status, or retries exhausted.

    The message is one line naming the server, the endpoint, the sample and the last error.
    """

    def __init__(
        self, message: str, *, server: str = "", endpoint: str = "", last_error: str = "", tries: int = 0
    ) -> None:
        super().__init__(message)
        self.server, self.endpoint, self.last_error, self.tries = server, endpoint, last_error, tries


class ContextLengthError(ServerError):
    """The server's context is smaller than a prompt plus ``max_tokens``."""


class _Cancelled(Exception):
    """A request given up because another one failed for good (never leaves this module)."""


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1[/]`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


def context_advice(body: str, max_tokens: int) -> str | None:
    """What to change when the server says a request does not fit its context; None otherwise."""
    if "context length" not in body.lower() and "max_model_len" not in body.lower():
        return None
    context = _CONTEXT_RE.search(body)
    prompt = next((m for m in (r.search(body) for r in _PROMPT_RES) if m), None)
    longer = "serve the model with a longer context (vLLM: --max-model-len"
    new_eval = "(a new evaluation: use a new --out)"
    if context is None:
        return (
            f"the prompt + --max-tokens {max_tokens} does not fit the server's context: lower --max-tokens "
            f"{new_eval} or {longer})"
        )
    c = int(context.group(1))
    if prompt is None:
        return (
            f"the server's context is {c} tokens, too small for the prompt + --max-tokens {max_tokens}: lower "
            f"--max-tokens below {c} minus the prompt's length {new_eval}, or {longer})"
        )
    p = int(prompt.group(prompt.lastindex or 1))
    if "at least" in prompt.group(0).lower():  # vLLM counted only up to what would have fitted
        return (
            f"the server's context of {c} tokens is smaller than the prompt (at least {p} tokens) + --max-tokens "
            f"{max_tokens}: lower --max-tokens to {c} minus the prompt's length or less {new_eval}, or {longer} "
            f"{p + max_tokens} or more)"
        )
    fix = f"pass --max-tokens {c - p} or less" if c > p else "shorten the prompt"
    return (
        f"the server's context of {c} tokens is smaller than the prompt ({p} tokens) + --max-tokens {max_tokens}: "
        f"{fix} {new_eval}, or {longer} {p + max_tokens})"
    )


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
        backoff_s: the first retry waits about this long, then 2x, 4x, ... (capped at 60 s, jittered).
        timeout_s: per-request timeout; None: ``default_timeout_s(max_tokens)``.
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
        timeout_s: float | None = None,
        api_key: str | None = None,
    ) -> None:
        if api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
        if concurrency < 1:
            raise ValueError(f"server.concurrency must be >= 1, got {concurrency}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"server.timeout_s must be > 0, got {timeout_s}")
        self.retry = RetryPolicy(max_retries=max_retries, backoff_s=backoff_s)
        self.base = api_base(url)
        self.api = api
        self.tokenizer_path = str(tokenizer) if isinstance(tokenizer, (str, Path)) else None
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.retries_used = 0
        self.max_model_len: int | None = None
        self._rng = random.Random()
        self._lock = threading.Lock()
        self.model = model or self._first_model()
        if model is not None:
            self._read_max_model_len(quiet=True)

    @property
    def max_retries(self) -> int:
        return self.retry.max_retries

    def describe(self) -> dict[str, Any]:
        return {"backend": "server", "url": self.base, "api": self.api, "model": self.model}

    def identity(self) -> dict[str, Any]:
        """What a resumed evaluation must share with this one (the URL may change, the model may not)."""
        return {"backend": "server", "model": self.model, "api": self.api, "tokenizer": self.tokenizer_path}

    # --- one HTTP call --------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _send(self, path: str, data: bytes | None, timeout: float) -> dict[str, Any]:
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=self._headers(), method=method)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))

    def _wait(self, retry: int, retry_after: float | None, stop: threading.Event | None) -> None:
        with self._lock:
            self.retries_used += 1
            delay = self.retry.delay_s(retry, self._rng)
        if retry_after is not None:
            delay = max(delay, min(self.retry.backoff_cap_s, retry_after))
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            raise _Cancelled()

    def _request(
        self,
        path: str,
        payload: dict[str, Any] | None,
        timeout: float = MODELS_TIMEOUT_S,
        stop: threading.Event | None = None,
        what: str = "",
    ) -> dict[str, Any]:
        """One call with retries; returns the decoded JSON body or raises ``ServerError``."""
        data = None if payload is None else json.dumps(payload).encode()
        where = f"server {self.base}, endpoint {path}" + (f", {what}" if what else "")
        last_error, retry_after = "", None
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                self._wait(attempt, retry_after, stop)
            if stop is not None and stop.is_set():
                raise _Cancelled()
            retry_after = None
            try:
                return self._send(path, data, timeout)
            except urllib.error.HTTPError as exc:
                body = _one_line(exc.read().decode("utf-8", "replace"))
                last_error = f"HTTP {exc.code}: {body}"
                if not is_retryable_status(exc.code):
                    raise self._fatal(where, path, last_error, attempt + 1, exc.code, body, payload) from exc
                retry_after = _retry_after(exc)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
                # refused / reset / died mid-answer / timed out / not JSON (json's error is a ValueError)
                last_error = _one_line(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")
        tries = self.retry.max_retries + 1
        raise ServerError(
            f"{where}: failed after {tries} tries; last error {last_error}",
            server=self.base,
            endpoint=path,
            last_error=last_error,
            tries=tries,
        )

    def _fatal(
        self, where: str, path: str, last_error: str, tries: int, code: int, body: str, payload: dict[str, Any] | None
    ) -> ServerError:
        advice = context_advice(body, int((payload or {}).get("max_tokens", 0))) if code == 400 else None
        kind = ServerError if advice is None else ContextLengthError
        message = f"{where}: {last_error}" + (f"; {advice}" if advice else "")
        return kind(message, server=self.base, endpoint=path, last_error=last_error, tries=tries)

    # --- the model ------------------------------------------------------------------------------

    def _first_model(self) -> str:
        models = self._request("/models", None).get("data") or []
        if not models:
            raise ServerError(f"server {self.base}, endpoint /models lists no model; pass --model", server=self.base)
        self._note_max_model_len(models[0])
        return str(models[0]["id"])

    def _read_max_model_len(self, quiet: bool) -> None:
        """Best effort: vLLM lists each model's ``max_model_len`` under ``/v1/models``."""
        try:
            models = self._send("/models", None, MODELS_TIMEOUT_S).get("data") or []
        except Exception:  # noqa: BLE001 - optional information; the evaluation's requests will tell
            if not quiet:
                raise
            return
        for card in models:
            if isinstance(card, dict) and card.get("id") == self.model:
                self._note_max_model_len(card)

    def _note_max_model_len(self, card: dict[str, Any]) -> None:
        value = card.get("max_model_len") if isinstance(card, dict) else None
        self.max_model_len = int(value) if isinstance(value, int) and value > 0 else None

    def check_fits(self, cfg: SamplingConfig) -> None:
        """Refuse, before any request, a ``max_tokens`` that leaves no room for a prompt in the context."""
        if self.max_model_len is not None and cfg.max_tokens >= self.max_model_len:
            raise ContextLengthError(
                f"server {self.base}: --max-tokens {cfg.max_tokens} leaves no room for a prompt in the context of "
                f"model {self.model!r} ({self.max_model_len} tokens, /v1/models max_model_len): lower --max-tokens "
                f"or serve the model with a longer context (vLLM: --max-model-len)",
                server=self.base,
                endpoint="/models",
            )

    # --- one sample -----------------------------------------------------------------------------

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

    def complete(self, job: Job, cfg: SamplingConfig, stop: threading.Event | None = None) -> Completion:
        """One sample for one job; ``stop`` set (by ``generate``) cuts its retries short."""
        path, payload = self._payload(job, cfg)
        timeout = self.timeout_s if self.timeout_s is not None else default_timeout_s(cfg.max_tokens)
        body = self._request(path, payload, timeout=timeout, stop=stop, what=job.name)
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(
                f"server {self.base}, endpoint {path}: unexpected response {_one_line(str(body))}",
                server=self.base,
                endpoint=path,
                last_error=_one_line(str(body)),
                tries=1,
            ) from exc
        return Completion(text or "", "length" if choice.get("finish_reason") == "length" else "stop")

    # --- many samples, failing fast -------------------------------------------------------------

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        """Yield ``(job, completion)`` as they complete; after a fatal error, yield what completes
        within the grace period, then raise it (see the module docstring)."""
        self.check_fits(cfg)
        todo: queue.SimpleQueue[Job] = queue.SimpleQueue()
        for job in jobs:
            todo.put(job)
        done: queue.SimpleQueue[tuple[Job, Completion | None, BaseException | None]] = queue.SimpleQueue()
        stop = threading.Event()
        for _ in range(min(self.concurrency, len(jobs))):
            threading.Thread(target=self._worker, args=(todo, done, stop, cfg), daemon=True).start()
        outstanding, fatal, deadline = len(jobs), None, None
        try:
            while outstanding:
                timeout = 0.5 if deadline is None else deadline - time.monotonic()
                if timeout <= 0:
                    break  # the grace period is over: abandon what is still in flight
                try:
                    job, completion, error = done.get(timeout=timeout)
                except queue.Empty:
                    continue
                outstanding -= 1
                if completion is not None:
                    yield job, completion
                elif fatal is None and not isinstance(error, _Cancelled):
                    fatal = error
                    stop.set()
                    outstanding -= _drain(todo)
                    deadline = time.monotonic() + self.retry.grace_s
        finally:
            stop.set()
            _drain(todo)
        if fatal is not None:
            raise fatal

    def _worker(
        self, todo: queue.SimpleQueue, done: queue.SimpleQueue, stop: threading.Event, cfg: SamplingConfig
    ) -> None:
        while not stop.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((job, self.complete(job, cfg, stop), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                if not isinstance(exc, _Cancelled):
                    stop.set()  # at once: no worker sends another request after a fatal error
                done.put((job, None, exc))


def _drain(todo: queue.SimpleQueue) -> int:
    """Empty the queue of requests not yet sent; returns how many were cancelled."""
    n = 0
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            return n
        n += 1


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    value = exc.headers.get("Retry-After") if exc.headers is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
