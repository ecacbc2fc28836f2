"""``python -m verl_sat.eval --server`` against a fake OpenAI server that dies.

The fake server (``FakeOpenAI``: ``http.server`` on 127.0.0.1, an ephemeral port, a thread) is
seeded: a response is a function of (problem, seed), so a resumed evaluation can be compared
with an uninterrupted one sample by sample. It dies after N answers, either by closing its
socket (connection refused, like a killed vLLM) or by answering 503 to everything (a proxy
in front of a dead server), and it logs every request it gets. One test times one thing, the
promise docs/eval.md makes: a dead server is given up on in under a minute (counted from its
death, so that the start-up's imports do not count). The retries are the ``openai`` client's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from verl_sat.eval.data import Problem, load_problems
from verl_sat.eval.jobs import SamplingConfig, build_messages, render_prompt
from verl_sat.eval.sampling import EvalIncomplete, main, run_eval
from verl_sat.eval.server import GRACE_S, ServerBackend, context_advice
from verl_sat.eval.store import read_samples

REPO = Path(__file__).resolve().parents[1]
START_S = 600  # a hang guard: importing verl_sat (verl, math-verify) took minutes at load average 20-37
VLLM_028_CONTEXT = (
    "This model's maximum context length is {c} tokens. However, you requested {m} output tokens and your "
    "prompt contains {p} input tokens, for a total of {t} tokens. Please reduce the length of the input "
    "prompt or the number of requested output tokens."
)


# ---------------------------------------------------------------------------------------------
# The fake server
# ---------------------------------------------------------------------------------------------


def seeded_response(problem: Problem, seed: int | None) -> str:
    """What the fake server answers: a function of (problem, seed); right about half of the time."""
    rng = random.Random(f"{problem.id}:{seed}") if seed is not None else random.Random()
    answer = int(problem.answer) + (0 if rng.random() < 0.5 else rng.randint(1, 9))
    words = " ".join(rng.choice(("so", "then", "we", "sum", "factor", "check")) for _ in range(8))
    return f"{words}.\nAnswer: {answer}"


class FakeOpenAI:
    """A seeded OpenAI-compatible server that dies after ``die_after`` answers.

    Args:
        problems: the problems it answers (found in the prompt by their question).
        model: the id ``/v1/models`` lists.
        die_after: answers before it dies (None: never).
        death: ``"close"`` (stop listening: connection refused; the request that finds it dead is
            dropped without an answer) or ``"503"`` (answer 503 to every request from then on).
        context: a context length in words; a request with prompt words + max_tokens above it
            gets vLLM 0.28's 400.
        delay_s: seconds before each answer.
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        model: str = "fake-model",
        die_after: int | None = None,
        death: str = "close",
        context: int | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.problems, self.model, self.die_after, self.death = problems, model, die_after, death
        self.context, self.delay_s = context, delay_s
        self.requests: list[dict] = []  # every POST, in arrival order
        self.answered = 0
        self.dead = False
        self.died_at: float | None = None  # time.monotonic() at its death
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def seeds(self, answered: bool | None = None) -> list[int]:
        """Seeds of the requests it got (``answered``: only those it answered, or only the others)."""
        return [r["seed"] for r in self.requests if answered is None or r["answered"] == answered]

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def _die(self) -> None:
        self.dead, self.died_at = True, time.monotonic()
        if self.death == "close":
            threading.Thread(target=self._close, daemon=True).start()

    def delay(self, body: dict) -> float:
        """Seconds before answering this request."""
        return self.delay_s

    def _answer(self, body: dict) -> tuple[int, dict]:
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        problem = next(p for p in self.problems if p.question in prompt)
        if self.context is not None and len(prompt.split()) + body["max_tokens"] > self.context:
            p, m = len(prompt.split()), body["max_tokens"]
            message = VLLM_028_CONTEXT.format(c=self.context, m=m, p=p, t=p + m)
            return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        text = seeded_response(problem, body.get("seed"))
        if "messages" in body:
            return 200, {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        return 200, {"choices": [{"text": text, "finish_reason": "stop"}]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(fake.delay(body))
                with fake.lock:
                    record = {"path": self.path, "seed": body.get("seed"), "answered": False}
                    fake.requests.append(record)
                    if not fake.dead and fake.die_after is not None and fake.answered >= fake.die_after:
                        fake._die()
                    if fake.dead:
                        if fake.death == "503":
                            self._send(503, {"error": "upstream is gone"})
                        else:
                            self.close_connection = True  # dropped: the client sees the connection die
                        return
                    code, answer = fake._answer(body)
                    if code == 200:
                        fake.answered += 1
                        record["answered"] = True
                    self._send(code, answer)

        return Handler


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

N_PROBLEMS, K = 6, 8


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    rows = [
        {"id": f"p{i}", "question": f"Problem {i}: what is {i} squared plus seven?", "answer": i * i + 7}
        for i in range(N_PROBLEMS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli_args(url: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--server",
        url,
        "--data",
        str(data),
        "--out",
        str(out),
        "--k",
        str(K),
        "--max-tokens",
        "64",
        "--quiet",
        *extra,
    ]


def run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_sat.eval", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def pairs(out: Path) -> list[tuple[str, int]]:
    return [(r["problem_id"], r["sample_index"]) for r in read_samples(out / "samples.jsonl")]


def all_seeds() -> set[int]:
    return set(range(N_PROBLEMS * K))  # --seed 0: seed = i * k + j


# ---------------------------------------------------------------------------------------------
# Fail fast, keep what was drawn
# ---------------------------------------------------------------------------------------------


def test_killed_server_makes_the_command_exit_with_one_line_and_keeps_the_samples(data: Path, tmp_path: Path) -> None:
    """The issue's case, as a user runs it, with the default retries: the server stops listening
    after 10 answers; the command gives up in under a minute and keeps every answered sample."""
    problems = load_problems(data)
    out = tmp_path / "out"
    with FakeOpenAI(problems, die_after=10, death="close") as fake:
        done = run_cli(cli_args(fake.url, data, out, "--concurrency", "4"), timeout=START_S + 120)
        exited_at = time.monotonic()
    assert done.returncode == 1, done.stderr
    assert fake.died_at is not None and exited_at - fake.died_at < 60  # docs/eval.md: under a minute
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith(f"verl_sat.eval: server {fake.url}/v1, endpoint /completions, problem p")
    assert "failed after 6 tries; last error APIConnectionError" in line, line
    assert "ConnectionRefusedError" in line or "RemoteProtocolError" in line, line
    assert f"; 10 of {N_PROBLEMS * K} samples drawn" in line and "--resume" in line
    kept = read_samples(out / "samples.jsonl")  # every answered sample on disk, once; nothing else
    assert len(kept) == 10 == len(set(pairs(out)))
    assert sorted(r["seed"] for r in kept) == sorted(fake.seeds(answered=True))
    assert not (out / "summary.json").exists()  # no summary for an unfinished evaluation


def test_samples_answered_during_the_grace_are_kept(data: Path, tmp_path: Path) -> None:
    """A request that fails for good does not throw away the answers still in flight: the slow
    requests answered within the grace after a 400 are on disk (and the queued ones never sent)."""
    problems = load_problems(data)

    class OneBadRequest(FakeOpenAI):
        def delay(self, body: dict) -> float:
            return 0.0 if body.get("seed") == 0 else 2.0  # the others are still generating at the 400

        def _answer(self, body: dict) -> tuple[int, dict]:
            if body.get("seed") == 0:
                return 400, {"error": {"message": "bad request", "type": "BadRequestError", "code": 400}}
            return super()._answer(body)

    out = tmp_path / "out"
    with OneBadRequest(problems) as fake:
        with pytest.raises(SystemExit, match=r"HTTP 400: .*bad request.*; 3 of 48 samples drawn"):
            main(cli_args(fake.url, data, out, "--concurrency", "4"))
    assert 2.0 < GRACE_S  # the three slow answers fit in the grace
    assert len(fake.requests) == 4  # the first four only: nothing sent after the 400
    assert sorted(r["seed"] for r in read_samples(out / "samples.jsonl")) == [1, 2, 3]


def test_failing_server_cancels_the_queued_requests(data: Path, tmp_path: Path) -> None:
    """A proxy answering 503 once its server died: after the death the server sees only the
    requests that were in flight, each at most max_retries + 1 times; no queued request is sent
    (without failing fast it would see all 38 remaining requests, 3 times each)."""
    problems = load_problems(data)
    concurrency, retries = 4, 2
    out = tmp_path / "out"
    with FakeOpenAI(problems, die_after=10, death="503") as fake:
        args = cli_args(fake.url, data, out, "--concurrency", str(concurrency), "--max-retries", str(retries))
        with pytest.raises(SystemExit, match=r"HTTP 503: .*; 10 of 48 samples drawn") as info:
            main(args)
    assert "\n" not in str(info.value.code)
    after_death = len(fake.requests) - fake.answered
    assert 0 < after_death <= concurrency * (retries + 1)
    assert len(read_samples(out / "samples.jsonl")) == 10 and not (out / "summary.json").exists()


def test_resume_completes_without_redrawing_and_equals_an_uninterrupted_run(data: Path, tmp_path: Path) -> None:
    problems = load_problems(data)
    out, reference = tmp_path / "out", tmp_path / "reference"
    with FakeOpenAI(problems, die_after=13) as dying:
        with pytest.raises(SystemExit, match="13 of 48 samples drawn"):
            main(cli_args(dying.url, data, out, "--max-retries", "1"))
    kept_seeds = {r["seed"] for r in read_samples(out / "samples.jsonl")}
    assert len(kept_seeds) == 13
    # a fresh run into the same --out would throw them away: refused
    with FakeOpenAI(problems) as healthy, pytest.raises(SystemExit, match="holds 13 samples .* add --resume"):
        main(cli_args(healthy.url, data, out))
    with FakeOpenAI(problems) as healthy:  # restarted elsewhere: the URL may change, the model may not
        summary = main(cli_args(healthy.url, data, out, "--resume"))
    assert set(healthy.seeds()) == all_seeds() - kept_seeds and len(healthy.seeds()) == 48 - 13  # none redrawn
    assert sorted(pairs(out)) == sorted({(p.id, j) for p in problems for j in range(K)})  # exactly k per problem
    assert [row["n"] for row in summary["per_problem"]] == [K] * N_PROBLEMS
    assert summary["resumed_from"] == 13
    with FakeOpenAI(problems) as once:
        uninterrupted = main(cli_args(once.url, data, reference))
    assert (out / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()
    assert summary["per_problem"] == uninterrupted["per_problem"] and summary["avg@8"] == uninterrupted["avg@8"]
    assert json.loads((out / "summary.json").read_text())["pass@k_curve"] == uninterrupted["pass@k_curve"]


@pytest.mark.parametrize(
    ("changed", "key"),
    [
        (["--k", "4"], "k"),
        (["--temperature", "0.7"], "temperature"),
        (["--max-tokens", "32"], "max_tokens"),
        (["--seed", "3"], "seed"),
        (["--limit", "5"], "data"),
        (["--api", "chat"], "api"),
        (["--instruction", "Think."], "instruction"),
    ],
)
def test_resume_refuses_other_settings(data: Path, tmp_path: Path, changed: list[str], key: str) -> None:
    problems = load_problems(data)
    out = tmp_path / "out"
    with FakeOpenAI(problems, die_after=5) as dying, pytest.raises(SystemExit):
        main(cli_args(dying.url, data, out, "--max-retries", "0"))
    before = (out / "samples.jsonl").read_text()
    with FakeOpenAI(problems) as healthy:
        with pytest.raises(SystemExit, match=rf"--resume refused: .* was drawn with {key}=.*this run has {key}="):
            main([*cli_args(healthy.url, data, out, "--resume"), *changed])
        assert healthy.requests == []  # nothing drawn
    assert (out / "samples.jsonl").read_text() == before  # nothing lost


def test_resume_refuses_another_model(data: Path, tmp_path: Path) -> None:
    problems = load_problems(data)
    out = tmp_path / "out"
    with FakeOpenAI(problems, die_after=5) as dying, pytest.raises(SystemExit):
        main(cli_args(dying.url, data, out, "--max-retries", "0"))
    with FakeOpenAI(problems, model="another-checkpoint") as other:
        with pytest.raises(SystemExit, match=r"model='fake-model', this run has model='another-checkpoint'"):
            main(cli_args(other.url, data, out, "--resume"))


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, as at a terminal, also where the runner inherited it ignored
    (a job started with ``&`` by a non-interactive shell, where the signal would never land)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupt_keeps_the_samples(data: Path, tmp_path: Path, sigint_raises: None) -> None:
    """Ctrl-C (SIGINT) mid-run: exit 130, every line on disk a whole sample, --resume continues."""
    problems = load_problems(data)
    out = tmp_path / "out"
    finished = threading.Event()

    def press_ctrl_c(fake: FakeOpenAI) -> None:
        while fake.answered < 6 and not finished.is_set():
            time.sleep(0.01)
        if not finished.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    with FakeOpenAI(problems, delay_s=0.1) as slow:  # 42 more answers take >= 2 s: the signal lands mid-run
        threading.Thread(target=press_ctrl_c, args=(slow,), daemon=True).start()
        try:
            with pytest.raises(SystemExit) as info:
                main(cli_args(slow.url, data, out, "--concurrency", "2"))
        finally:
            finished.set()
    assert info.value.code == 130
    kept = read_samples(out / "samples.jsonl")
    assert 0 < len(kept) < N_PROBLEMS * K and not (out / "summary.json").exists()
    assert {r["seed"] for r in kept} <= set(slow.seeds(answered=True))  # whole samples, as answered
    with FakeOpenAI(problems) as healthy:
        summary = main(cli_args(healthy.url, data, out, "--resume"))
    assert len(healthy.seeds()) == N_PROBLEMS * K - len(kept)
    assert [row["n"] for row in summary["per_problem"]] == [K] * N_PROBLEMS


# ---------------------------------------------------------------------------------------------
# Errors that retrying cannot fix
# ---------------------------------------------------------------------------------------------


def test_context_too_small_names_the_problem_and_the_fix(data: Path, tmp_path: Path) -> None:
    problems = load_problems(data)
    with FakeOpenAI(problems, context=70) as fake:  # prompts are ~40 words: 40 + 64 > 70
        backend = ServerBackend(fake.url, concurrency=2, max_retries=3)
        with pytest.raises(EvalIncomplete) as info:
            run_eval(problems, backend, SamplingConfig(k=K, max_tokens=64), tmp_path, progress=False)
    message = str(info.value)
    assert "\n" not in message and "HTTP 400" in message
    assert "problem p0 sample" in message
    prompt_words = len(prompt_of(problems[0]).split())  # the fake counts words as tokens
    # the server's numbers, then the fix
    assert "maximum context length is 70 tokens" in message and f"contains {prompt_words} input tokens" in message
    assert "lower --max-tokens below the context minus the prompt's length" in message
    assert "--max-model-len" in message and "--resume continues with the same --max-tokens" in message
    assert len(fake.requests) <= 2 and len(set(fake.seeds())) == len(fake.requests)  # none retried or sent after


def prompt_of(problem: Problem) -> str:
    return render_prompt(build_messages(problem))


def test_max_tokens_beyond_the_served_context_is_refused_before_any_request(data: Path, tmp_path: Path) -> None:
    problems = load_problems(data)
    with FakeOpenAI(problems) as fake:
        backend = ServerBackend(fake.url)
        backend.max_model_len = 64  # as vLLM's /v1/models reports it
        with pytest.raises(EvalIncomplete, match=r"--max-tokens 64 leaves no room .*\(64 tokens"):
            run_eval(problems, backend, SamplingConfig(k=2, max_tokens=64), tmp_path, progress=False)
        assert fake.requests == []


def test_max_model_len_is_read_from_the_model_list() -> None:
    class Card(FakeOpenAI):
        def _handler(self) -> type[BaseHTTPRequestHandler]:
            base = super()._handler()

            class Handler(base):  # type: ignore[misc, valid-type]
                def do_GET(self) -> None:
                    self._send(200, {"data": [{"id": "m", "max_model_len": 1024}]})

            return Handler

    with Card([]) as fake:
        assert ServerBackend(fake.url).max_model_len == 1024
        assert ServerBackend(fake.url, model="m").max_model_len == 1024


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "about_context"),
    [
        (VLLM_028_CONTEXT.format(c=1024, m=2000, p=300, t=2300), True),  # vLLM 0.28
        ("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens", True),
        ("Input length (2000) exceeds model's maximum context length (1024).", True),
        ("max_tokens=2000 cannot be greater than max_model_len=max_total_tokens=512.", True),  # SGLang
        ("Invalid model name", False),
    ],
)
def test_context_advice(body: str, about_context: bool) -> None:
    advice = context_advice(body)
    assert (advice is not None) == about_context
    assert advice is None or ("lower --max-tokens" in advice and "--max-model-len" in advice)


def test_torn_last_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text('{"problem_id": "a", "sample_index": 0}\n{"problem_id": "a", "sam')
    assert read_samples(path) == [{"problem_id": "a", "sample_index": 0}]
    assert path.read_text() == '{"problem_id": "a", "sample_index": 0}\n'  # cut, so appends start clean
    path.write_text('{"problem_id": "a"}\nnot json\n{"problem_id": "b"}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_samples(path)
