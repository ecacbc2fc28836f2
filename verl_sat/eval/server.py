"""An OpenAI-compatible server (vLLM, SGLang, vLLM's CPU build, ...) as the evaluation backend, through ``openai``.

One request per sample (``/v1/completions`` or ``/v1/chat/completions``), ``concurrency`` in
flight on one event loop (``openai.AsyncOpenAI``). What a request survives and what ends the
evaluation:

- **Retried** by the ``openai`` client, up to ``max_retries`` times: connection errors (refused,
  reset, a server that died mid-answer), timeouts, HTTP 408/409/429 and every 5xx. It waits
  0.5 s, then twice as long each time (at most 8 s, less up to 25% jitter), or what the server's
  ``Retry-After`` header asks (up to 2 min; a longer one is not retried).
- **Fatal**: retries exhausted, or any other status (400, 401, 404, ...). A 400 about the
  context length gets the fix appended (``context_advice``).
- **Fail fast**: after a fatal error no further request is sent; the requests in flight get
  ``GRACE_S`` to finish, what finishes is handed back with the rest, the others are cancelled
  (a request waiting in a backoff or on a socket stops at once), then the error is raised.

The per-request timeout defaults to ``60 s + max_tokens / 10 tokens/s`` (3132 s at 30,720 tokens):
a non-streamed completion sends nothing until its last token, so the timeout must cover a whole
generation. Connecting is given ``CONNECT_TIMEOUT_S``. docs/eval.md lists the flags.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import openai

from verl_sat.eval.jobs import Completion, Job, SamplingConfig, render_prompt

MIN_TOKENS_PER_S = 10.0  # the slowest per-sequence decode speed the default timeout allows for
TIMEOUT_FLOOR_S = 60.0
CONNECT_TIMEOUT_S = 5.0
MODELS_TIMEOUT_S = 60.0
# Seconds the requests in flight get to finish after a fatal error: the client's longest backoff step.
GRACE_S = 8.0


def default_timeout_s(max_tokens: int) -> float:
    """A per-request timeout that fits a whole non-streamed generation of ``max_tokens`` tokens."""
    return TIMEOUT_FLOOR_S + max_tokens / MIN_TOKENS_PER_S


class ServerError(RuntimeError):
    """A request failed for good: a non-retryable status, or retries exhausted.

    The message is one line naming the server, the endpoint, the sample and the last error.
    """


class ContextLengthError(ServerError):
    """The server's context is smaller than a prompt plus ``max_tokens``."""


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1[/]`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


def context_advice(body: str) -> str | None:
    """What to change when the server says a request does not fit its context; None otherwise.

    The server's own message (kept in the error line) gives the numbers: vLLM says "maximum
    context length is C tokens ... your prompt contains P input tokens".
    """
    if "context length" not in body.lower() and "max_model_len" not in body.lower():
        return None
    return (
        "the prompt + --max-tokens does not fit the server's context: lower --max-tokens below the context "
        "minus the prompt's length (a new evaluation: use a new --out), or serve the model with a longer "
        "context (vLLM: --max-model-len)"
    )


def _root_cause(exc: BaseException) -> str:
    """``Type: message`` of the innermost cause (e.g. ``ConnectionRefusedError: [Errno 111] ...``)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return _one_line(f"{type(exc).__name__}: {exc}")


async def _settle(tasks: Iterable[asyncio.Task], client: openai.AsyncOpenAI) -> None:
    """Wait for cancelled requests to unwind, then close the client's connections."""
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()


class ServerBackend:
    """An OpenAI-compatible ``/v1/completions`` or ``/v1/chat/completions`` endpoint.

    Args:
        url: server address (``http://127.0.0.1:8000`` or ``.../v1``).
        model: model name for the request; None asks ``GET /v1/models`` for the first one.
        api: ``"completions"`` (prompt rendered here, with ``tokenizer``'s chat template if given)
            or ``"chat"`` (the server applies its template).
        tokenizer: a tokenizer (or a path to one) for rendering completions prompts.
        concurrency: requests in flight.
        max_retries: retries per request after the first try (the ``openai`` client's).
        timeout_s: per-request timeout; None: ``default_timeout_s(max_tokens)``.
        api_key: sent as ``Authorization: Bearer``; None reads ``OPENAI_API_KEY`` (else ``EMPTY``).
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api: str = "completions",
        tokenizer: Any | None = None,
        concurrency: int = 16,
        max_retries: int = 5,
        timeout_s: float | None = None,
        api_key: str | None = None,
    ) -> None:
        if api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
        if concurrency < 1:
            raise ValueError(f"server.concurrency must be >= 1, got {concurrency}")
        if max_retries < 0:
            raise ValueError(f"server.max_retries must be >= 0, got {max_retries}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"server.timeout_s must be > 0, got {timeout_s}")
        self.base = api_base(url)
        self.api = api
        self.tokenizer_path = str(tokenizer) if isinstance(tokenizer, (str, Path)) else None
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.max_model_len: int | None = None
        self.model = model or ""
        self._read_models(first=model is None)

    def describe(self) -> dict[str, Any]:
        return {"backend": "server", "url": self.base, "api": self.api, "model": self.model}

    def identity(self) -> dict[str, Any]:
        """What a resumed evaluation must share with this one (the URL may change, the model may not)."""
        return {"backend": "server", "model": self.model, "api": self.api, "tokenizer": self.tokenizer_path}

    # --- the model ------------------------------------------------------------------------------

    def _read_models(self, first: bool) -> None:
        """Take the first model ``/v1/models`` lists (``first``), and its ``max_model_len`` (vLLM lists it).

        Without ``first`` the list is optional information: the evaluation's requests will tell.
        """
        retries = self.max_retries if first else 0
        client = openai.OpenAI(base_url=self.base, api_key=self.api_key, max_retries=retries, timeout=MODELS_TIMEOUT_S)
        try:
            cards = list(client.models.list())
        except openai.APIError as exc:
            if first:
                raise self._error(exc, "/models", "the model list") from exc
            return
        finally:
            client.close()
        if first:
            if not cards:
                raise ServerError(f"server {self.base}, endpoint /models lists no model; pass --model")
            self.model = str(cards[0].id)
        for card in cards:
            value = getattr(card, "max_model_len", None)
            if card.id == self.model and isinstance(value, int) and value > 0:
                self.max_model_len = value

    def check_fits(self, cfg: SamplingConfig) -> None:
        """Refuse, before any request, a ``max_tokens`` that leaves no room for a prompt in the context."""
        if self.max_model_len is not None and cfg.max_tokens >= self.max_model_len:
            raise ContextLengthError(
                f"server {self.base}: --max-tokens {cfg.max_tokens} leaves no room for a prompt in the context of "
                f"model {self.model!r} ({self.max_model_len} tokens, /v1/models max_model_len): lower --max-tokens "
                f"or serve the model with a longer context (vLLM: --max-model-len)"
            )

    # --- one sample -----------------------------------------------------------------------------

    def _error(self, exc: openai.APIError, endpoint: str, what: str) -> ServerError:
        """One line: where, how many tries (the client's ``x-stainless-retry-count`` + 1), the last error."""
        request = getattr(exc, "request", None)
        tries = 1 + int(request.headers.get("x-stainless-retry-count", 0)) if request is not None else 1
        if isinstance(exc, openai.APIStatusError):
            last = f"HTTP {exc.status_code}: {_one_line(exc.response.text)}"
        else:
            last = f"{type(exc).__name__}: {exc} ({_root_cause(exc)})"
        where = f"server {self.base}, endpoint {endpoint}, {what}"
        message = f"{where}: failed after {tries} tries; last error {last}" if tries > 1 else f"{where}: {last}"
        advice = context_advice(last) if isinstance(exc, openai.BadRequestError) else None
        return ServerError(message) if advice is None else ContextLengthError(f"{message}; {advice}")

    async def complete(self, client: openai.AsyncOpenAI, job: Job, cfg: SamplingConfig) -> Completion:
        """One sample for one job (the client retries it)."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "n": 1,
        }
        if cfg.top_k != -1:
            kwargs["extra_body"] = {"top_k": cfg.top_k}  # a vLLM / SGLang extension; plain OpenAI rejects it
        if job.seed is not None:
            kwargs["seed"] = job.seed
        endpoint = "/chat/completions" if self.api == "chat" else "/completions"
        try:
            if self.api == "chat":
                out = await client.chat.completions.create(messages=[dict(m) for m in job.messages], **kwargs)
            else:
                out = await client.completions.create(prompt=render_prompt(job.messages, self.tokenizer), **kwargs)
        except openai.APIError as exc:
            raise self._error(exc, endpoint, job.name) from exc
        try:
            choice = out.choices[0]
            text = choice.message.content if self.api == "chat" else choice.text
        except (AttributeError, IndexError, TypeError) as exc:
            raise ServerError(
                f"server {self.base}, endpoint {endpoint}, {job.name}: unexpected response {_one_line(str(out))}"
            ) from exc
        return Completion(text or "", "length" if choice.finish_reason == "length" else "stop")

    # --- many samples, failing fast -------------------------------------------------------------

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        """Yield ``(job, completion)`` as they complete; after a fatal error, yield what completes
        within ``GRACE_S``, then raise it (see the module docstring).

        The event loop runs only inside this generator: between two ``yield`` s the caller scores
        and stores a sample while the server keeps generating the others.
        """
        self.check_fits(cfg)
        loop = asyncio.new_event_loop()
        timeout = self.timeout_s if self.timeout_s is not None else default_timeout_s(cfg.max_tokens)
        client = openai.AsyncOpenAI(
            base_url=self.base,
            api_key=self.api_key,
            max_retries=self.max_retries,
            timeout=openai.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
        )
        todo, running = iter(jobs), {}
        fatal: BaseException | None = None
        deadline: float | None = None
        try:
            while True:
                while fatal is None and len(running) < self.concurrency and (job := next(todo, None)) is not None:
                    running[loop.create_task(self.complete(client, job, cfg))] = job
                if not running:
                    break
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = loop.run_until_complete(
                    asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                )
                if not done:
                    break  # the grace period is over: cancel what is still in flight
                for task in done:
                    job = running.pop(task)
                    if task.exception() is None:
                        yield job, task.result()
                    elif fatal is None:
                        fatal, deadline = task.exception(), time.monotonic() + GRACE_S
        finally:
            for task in running:
                task.cancel()
            loop.run_until_complete(_settle(running, client))
            loop.close()
        if fatal is not None:
            raise fatal
