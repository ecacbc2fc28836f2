"""Tests of verl_sat.eval: avg@k / pass@k, data loading, run_eval, the server backend through ``openai``."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from verl_sat.eval.data import Problem, is_path_like, load_problems
from verl_sat.eval.jobs import Completion, Job, SamplingConfig, make_jobs
from verl_sat.eval.metrics import avg_at_k, pass_at_k, pass_at_k_per_problem
from verl_sat.eval.sampling import append_metrics, main, run_eval
from verl_sat.eval.server import ServerBackend, ServerError, api_base

# six AIME 2024 problems copied verbatim from ../shared/data/aime24.jsonl (public; its lines 1, 2, 8, 13, 16, 26)
AIME24 = Path(__file__).parent / "fixtures" / "data" / "aime24_sample.jsonl"


# ---------------------------------------------------------------------------------------------
# avg@k and pass@k
# ---------------------------------------------------------------------------------------------


def test_pass_at_k_known_values() -> None:
    assert pass_at_k_per_problem(2, 1, 1) == pytest.approx(0.5)
    assert pass_at_k_per_problem(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k_per_problem(16, 0, 16) == 0.0
    assert pass_at_k_per_problem(16, 1, 16) == 1.0
    assert avg_at_k([(16, 4), (16, 0), (16, 16)]) == pytest.approx((0.25 + 0 + 1) / 3)


def test_metric_errors_name_the_bad_input() -> None:
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k_per_problem(4, 1, 5)
    with pytest.raises(ValueError, match="correct count"):
        avg_at_k([(4, 5)])
    with pytest.raises(ValueError, match="at least one problem"):
        pass_at_k([], 1)


@st.composite
def problem_counts(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(st.integers(min_value=1, max_value=32))
    return n, draw(st.integers(min_value=0, max_value=n))


@settings(max_examples=200, deadline=None)
@given(problem_counts())
def test_pass_at_k_invariants(counts: tuple[int, int]) -> None:
    n, c = counts
    values = [pass_at_k_per_problem(n, c, k) for k in range(1, n + 1)]
    assert values[0] == pytest.approx(c / n)  # pass@1 is the per-problem accuracy
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))  # monotone in k
    assert all(-1e-12 <= v <= 1 + 1e-12 for v in values)
    assert all(v >= c / n - 1e-12 for v in values)  # pass@k >= avg
    assert values[0] == c / n  # exactly: avg@k == pass@1 to the last bit (docs/eval.md)
    assert values[-1] == (1.0 if c else 0.0)  # k = n: some sample right, exactly


@settings(max_examples=100, deadline=None)
@given(st.lists(problem_counts(), min_size=1, max_size=10))
def test_pass_at_1_is_avg_and_bounds(counts: list[tuple[int, int]]) -> None:
    assert pass_at_k(counts, 1) == pytest.approx(avg_at_k(counts))
    k = min(n for n, _ in counts)
    assert avg_at_k(counts) - 1e-12 <= pass_at_k(counts, k) <= 1 + 1e-12
    # pass@k is at least the fraction of problems solved by every sample.
    assert pass_at_k(counts, k) >= sum(c == n for n, c in counts) / len(counts) - 1e-12


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def test_load_aime24_jsonl() -> None:
    """AIME24's JSONL loads as the shared data ships it: zero-padded answers kept, ids are line numbers."""
    problems = load_problems(AIME24)
    assert len(problems) == 6
    assert [p.answer for p in problems] == ["204", "113", "025", "540", "073", "080"]
    assert [p.id for p in problems] == [str(i) for i in range(6)]
    assert problems[0].question.startswith("Every morning Aya") and problems[0].messages is None


def test_load_verl_parquet_and_plain_json(tmp_path: Path) -> None:
    import pandas as pd

    rows = [
        {
            "data_source": "aime24",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+1?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": 100 + i},
        }
        for i in range(3)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "aime.parquet")
    problems = load_problems(tmp_path / "aime.parquet")
    assert [(p.id, p.question, p.answer) for p in problems][0] == ("100", "What is 0+1?", "1")
    assert problems[0].messages is not None and problems[0].messages[0]["role"] == "system"
    (tmp_path / "p.json").write_text(json.dumps([{"problem": "Q", "answer": 5, "id": "a"}]))
    assert load_problems(tmp_path / "p.json") == [Problem("a", "Q", "5")]


def test_data_errors_name_path_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2"):
        load_problems(bad)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_problems(missing)
    (tmp_path / "nokey.jsonl").write_text('{"q": "x"}\n')
    with pytest.raises(ValueError, match=r"nokey.jsonl line 1.*found keys \['q'\]"):
        load_problems(tmp_path / "nokey.jsonl")
    assert is_path_like("./x.parquet") and not is_path_like("HuggingFaceH4/aime_2024")


# ---------------------------------------------------------------------------------------------
# run_eval on synthetic responses
# ---------------------------------------------------------------------------------------------


class ScriptedBackend:
    """Answers problem i correctly in the first ``n_correct[i]`` samples, wrongly in the rest."""

    def __init__(self, problems: Sequence[Problem], n_correct: Sequence[int]) -> None:
        self.problems, self.n_correct = problems, n_correct

    def generate(self, jobs: Sequence[Job], cfg: SamplingConfig) -> Iterator[tuple[Job, Completion]]:
        for job in reversed(jobs):  # out of order on purpose
            answer = int(self.problems[job.problem_index].answer)
            if job.sample_index >= self.n_correct[job.problem_index]:
                answer += 1
            yield job, Completion(f"Some work.\nAnswer: {answer}", "stop")

    def describe(self) -> dict:
        return {"backend": "scripted"}

    def identity(self) -> dict:
        return {"backend": "scripted"}


def test_run_eval_known_counts(tmp_path: Path) -> None:
    problems = [Problem(str(i), f"q{i}", f"{i:03d}") for i in range(4)]
    n_correct = [0, 1, 4, 8]
    summary = run_eval(problems, ScriptedBackend(problems, n_correct), SamplingConfig(k=8), tmp_path, progress=False)
    counts = [(8, c) for c in n_correct]
    assert summary["avg@8"] == pytest.approx(avg_at_k(counts)) == pytest.approx((0 + 1 / 8 + 0.5 + 1) / 4)
    assert summary["pass@8"] == pytest.approx(0.75)
    assert summary["pass@k_curve"]["1"] == pytest.approx(summary["avg@8"])
    assert set(summary["pass@k_curve"]) == {"1", "2", "4", "8"}
    assert [row["correct"] for row in summary["per_problem"]] == n_correct
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 32
    assert [(s["problem_id"], s["sample_index"]) for s in samples[:2]] == [("0", 0), ("0", 1)]
    assert (samples[8]["extracted_answer"], samples[8]["correct"]) == ("1", True)  # problem 1, sample 0
    assert (samples[9]["extracted_answer"], samples[9]["correct"]) == ("2", False)
    assert json.loads((tmp_path / "summary.json").read_text())["avg@8"] == summary["avg@8"]
    line = append_metrics(tmp_path / "run" / "metrics.jsonl", 5, summary)
    assert line == {"step": 5, "eval/aime24/avg@8": summary["avg@8"], "eval/aime24/pass@8": 0.75}


def test_sampling_config_validation_and_seeds() -> None:
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="sampling.top_k"):
        SamplingConfig(top_k=0)
    cfg = SamplingConfig(k=3)
    assert (cfg.temperature, cfg.top_p, cfg.top_k) == (1.0, 1.0, -1)
    paper = OmegaConf.load(Path(__file__).parents[1] / "hydra_configs" / "sat_paper.yaml")
    assert cfg.max_tokens == paper.data.max_response_length  # training's response cap
    assert paper.data.max_prompt_length + cfg.max_tokens + 1 <= 32768  # fits Qwen3-30B-A3B-Base's context
    jobs = make_jobs([Problem("a", "q", "1"), Problem("b", "q", "2")], cfg)
    assert [j.seed for j in jobs] == [0, 1, 2, 3, 4, 5]
    assert "\\boxed{}" in jobs[0].messages[0]["content"] and "Answer:" in jobs[0].messages[0]["content"]


# ---------------------------------------------------------------------------------------------
# Server path: a local OpenAI-compatible stub that fails its first requests
# ---------------------------------------------------------------------------------------------


class StubState:
    """What the stub server saw, and how it should misbehave: its first ``fail_first`` requests get
    ``status`` (with ``headers``)."""

    def __init__(
        self, problems: Sequence[Problem], fail_first: int = 1, status: int = 500, headers: dict | None = None
    ) -> None:
        self.problems = problems
        self.fail_first = fail_first
        self.status = status
        self.headers = headers or {}
        self.requests: list[dict] = []  # every POST, with its arrival time
        self.failures = 0
        self.lock = threading.Lock()


def make_handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def _send(self, code: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "tiny-stub", "object": "model"}]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests.append({"path": self.path, "at": time.monotonic(), **body})
                if state.failures < state.fail_first:
                    state.failures += 1
                    self._send(state.status, {"error": {"message": "transient"}}, state.headers)
                    return
            prompt = body.get("prompt") or body["messages"][-1]["content"]
            problem = next(p for p in state.problems if p.question in prompt)
            answer = int(problem.answer) + (0 if body["seed"] % 2 == 0 else 1)  # even seeds are right
            text = f"Reasoning...\nAnswer: {answer}"
            if self.path == "/v1/completions":
                self._send(
                    200,
                    {
                        "id": "c",
                        "object": "text_completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                    },
                )
            elif self.path == "/v1/chat/completions":
                message = {"role": "assistant", "content": text}
                self._send(
                    200,
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                    },
                )
            else:
                self._send(404, {"error": "not found"})

    return Handler


@pytest.fixture
def stub_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, StubState]]:
    problems = [Problem(str(i), f"Problem number {i}: compute things.", f"{10 * i + 7:03d}") for i in range(3)]
    fail_first, status, headers = (*getattr(request, "param", (1, 500)), None)[:3]
    state = StubState(problems, fail_first, status, headers)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_server_backend_with_transient_500(stub_server: tuple[str, StubState], api: str, tmp_path: Path) -> None:
    """A 500 is retried by the client (the request is sent again); the run then completes."""
    url, state = stub_server
    backend = ServerBackend(url, api=api, concurrency=4, max_retries=3)
    assert backend.model == "tiny-stub"
    cfg = SamplingConfig(k=4, max_tokens=64, top_k=20)
    summary = run_eval(state.problems, backend, cfg, tmp_path, progress=False)
    assert state.failures == 1
    assert len(state.requests) == 3 * 4 + 1  # every sample once, the failed one twice
    assert summary["avg@4"] == pytest.approx(0.5)  # samples 0 and 2 of each problem are right
    assert summary["pass@4"] == pytest.approx(1.0)
    assert summary["pass@k_curve"]["1"] == pytest.approx(0.5)
    sent = state.requests[-1]
    assert sent["path"] == ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    assert (sent["model"], sent["temperature"], sent["top_p"], sent["top_k"], sent["max_tokens"]) == (
        "tiny-stub",
        1.0,
        1.0,
        20,
        64,
    )
    assert len({r["seed"] for r in state.requests}) == 12
    assert summary["truncated_frac"] == (1.0 if api == "chat" else 0.0)


@pytest.mark.parametrize("stub_server", [(2, 429, {"Retry-After": "2"})], indirect=True)
def test_429_is_retried_after_the_servers_retry_after(stub_server: tuple[str, StubState], tmp_path: Path) -> None:
    """Two 429s with ``Retry-After: 2``, then 200: the request is sent three times, each retry at least
    2 s after the one before (the client's own backoff would wait at most 0.5 s, then 1 s)."""
    url, state = stub_server
    backend = ServerBackend(url, model="m", concurrency=1, max_retries=2)
    summary = run_eval(state.problems[:1], backend, SamplingConfig(k=1), tmp_path, progress=False)
    assert summary["per_problem"][0]["n"] == 1
    assert len(state.requests) == 3 and len({r["seed"] for r in state.requests}) == 1  # one sample, three tries
    gaps = [b["at"] - a["at"] for a, b in zip(state.requests, state.requests[1:], strict=False)]
    assert all(gap >= 2.0 for gap in gaps), gaps


@pytest.mark.parametrize("stub_server", [(1, 400)], indirect=True)
def test_server_client_error_is_not_retried(stub_server: tuple[str, StubState]) -> None:
    url, state = stub_server
    backend = ServerBackend(url + "/v1/", model="m", max_retries=3)
    jobs = make_jobs(state.problems[:1], SamplingConfig(k=1))
    with pytest.raises(ServerError, match=r"endpoint /completions, problem 0 sample 0: HTTP 400: .*transient"):
        list(backend.generate(jobs, SamplingConfig(k=1)))
    assert len(state.requests) == 1


@pytest.mark.parametrize("stub_server", [(10, 503)], indirect=True)
def test_server_retries_exhausted(stub_server: tuple[str, StubState]) -> None:
    url, state = stub_server
    backend = ServerBackend(url, model="m", max_retries=2)
    jobs = make_jobs(state.problems[:1], SamplingConfig(k=1))
    with pytest.raises(ServerError, match="failed after 3 tries; last error HTTP 503"):
        list(backend.generate(jobs, SamplingConfig(k=1)))
    assert len(state.requests) == 3


def test_cli_against_the_stub(stub_server: tuple[str, StubState], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``--server`` with ``--data`` a JSONL path: prints avg@k and appends the step's metrics to ``--log-to``."""
    url, state = stub_server
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in state.problems))
    argv = ["--server", url, "--data", str(data), "--k", "2", "--max-tokens", "4", "--out", str(tmp_path / "o")]
    summary = main([*argv, "--quiet", "--log-to", str(tmp_path / "m.jsonl"), "--step", "10"])
    assert summary["source"] == str(data) and summary["avg@2"] == pytest.approx(0.5)
    assert "avg@2 = 50.00%" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {
        "step": 10,
        "eval/aime24/avg@2": 0.5,
        "eval/aime24/pass@2": 1.0,
    }


def test_api_base() -> None:
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"
    assert api_base("http://h:1/v1/completions") == "http://h:1/v1"
