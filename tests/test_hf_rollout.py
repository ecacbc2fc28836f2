"""Tests of the HF rollout backend (verl_sat.rollout): sampling, batched generation, log-prob
parity with a trainer-style forward, abort/resume with partial tokens, and the version tag."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from verl_sat.default import data as task
from verl_sat.default import model as tiny
from verl_sat.rollout.engine import EngineOptions, GenerationRequest, HFEngine, logit_noise_for
from verl_sat.rollout.sampling import RowSampling, SamplingParams, sample_next
from verl_sat.rollout.weights import refuse_moe_params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3-MoE + tokenizer (no warm-up needed for these tests)."""
    torch.set_num_threads(1)
    return tiny.create(tmp_path_factory.mktemp("tiny_moe"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(str(model_dir), EngineOptions(seed=0))


def _prompts(model_dir: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, problem in enumerate(task.sample_problems(n, seed=3)):
        messages = [{"role": "user", "content": task.make_prompt(problem)}]
        ids = list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
        out.append(ids[i % 3 :])  # ragged lengths exercise left padding
    return out


def _trainer_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """What verl's actor recomputes: log_softmax(logits / T=1) of the response, one full forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None]).logits[0]
    logits = logits[len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


# ---------------------------------------------------------------- sampling


def test_full_support_log_probs_equal_log_softmax() -> None:
    logits = torch.randn(4, 11)
    rows = RowSampling.stack([SamplingParams(temperature=0.7)] * 4)
    tokens, log_probs = sample_next(logits, rows, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected)


def test_top_k_and_top_p_restrict_support_and_renormalise() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    rows = RowSampling.stack([SamplingParams(top_k=2), SamplingParams(top_p=0.5)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        tokens, log_probs = sample_next(logits, rows, gen)
        assert tokens[0] in (0, 1) and tokens[1] == 0
        top2 = torch.log_softmax(logits[0, :2], -1)
        assert torch.isclose(log_probs[0], top2[tokens[0]])
        assert torch.isclose(log_probs[1], torch.tensor(0.0))


def test_greedy_has_zero_log_prob() -> None:
    logits = torch.randn(3, 7)
    tokens, log_probs = sample_next(logits, RowSampling.stack([SamplingParams(temperature=0.0)] * 3))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.all(log_probs == 0)


def test_refuse_moe_params_inverts_verl_unfuse() -> None:
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    packed = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 5),
        "model.layers.0.mlp.experts.down_proj": torch.randn(3, 5, 4),
        "model.norm.weight": torch.randn(5),
    }
    roundtrip = refuse_moe_params(dict(unfuse_moe_params(packed.items(), "qwen3_moe")))
    assert roundtrip.keys() == packed.keys()
    for name, tensor in packed.items():
        torch.testing.assert_close(roundtrip[name], tensor)


# ---------------------------------------------------------------- engine


def test_batched_generation_matches_trainer_log_probs(engine: HFEngine, model_dir: Path) -> None:
    prompts = _prompts(model_dir, 6)
    requests = [GenerationRequest(p, SamplingParams(), max_tokens=12) for p in prompts]
    results = engine.generate_batch(requests)
    assert all(r.stop_reason in ("completed", "length") for r in results)
    assert all(0 < len(r.token_ids) <= 12 for r in results)
    for prompt, result in zip(prompts, results, strict=True):
        expected = _trainer_log_probs(engine.model, prompt, result.token_ids)
        assert (expected - torch.tensor(result.log_probs)).abs().max().item() < 1e-5


def test_per_request_budgets(engine: HFEngine, model_dir: Path) -> None:
    prompts = _prompts(model_dir, 3)
    budgets = [0, 1, 5]
    results = engine.generate_batch(
        [GenerationRequest(p, SamplingParams(), b) for p, b in zip(prompts, budgets, strict=True)]
    )
    assert [len(r.token_ids) <= b for r, b in zip(results, budgets, strict=True)] == [True] * 3
    assert results[0].token_ids == [] and results[0].stop_reason == "length"


def test_abort_returns_partial_tokens(engine: HFEngine, model_dir: Path) -> None:
    calls = {"n": 0}

    def abort_after_three_steps() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    eos = engine.eos_token_ids
    engine.eos_token_ids = set()  # never stop early, so the abort is what ends generation
    try:
        results = engine.generate_batch(
            [GenerationRequest(p, SamplingParams(), 20) for p in _prompts(model_dir, 2)], abort_after_three_steps
        )
    finally:
        engine.eos_token_ids = eos
    assert all(r.stop_reason == "aborted" and len(r.token_ids) == 3 == len(r.log_probs) for r in results)


def test_logit_noise_changes_rollout_distribution(model_dir: Path) -> None:
    noisy = HFEngine.from_pretrained(str(model_dir), EngineOptions(logit_noise_std=1.0, seed=0))
    prompt = _prompts(model_dir, 1)[0]
    result = noisy.generate_batch([GenerationRequest(prompt, SamplingParams(), 8)])[0]
    expected = _trainer_log_probs(noisy.model, prompt, result.token_ids)
    assert (expected - torch.tensor(result.log_probs)).abs().max().item() > 1e-3


def test_fault_step_switches_the_noise_by_weight_version(engine: HFEngine, model_dir: Path) -> None:
    options = EngineOptions(fault_step=3, fault_logit_noise_std=3.0)
    assert [logit_noise_for(options, v) for v in (None, 0, 2, 3, 9)] == [0.0, 0.0, 0.0, 3.0, 3.0]
    assert logit_noise_for(EngineOptions(logit_noise_std=0.5), 10**6) == 0.5  # fault_step -1: never
    prompt = _prompts(model_dir, 1)[0]
    gaps = []
    for version in (2, 3):
        engine.logit_noise_std = logit_noise_for(options, version)
        try:
            result = engine.generate_batch([GenerationRequest(prompt, SamplingParams(), 8)])[0]
        finally:
            engine.logit_noise_std = 0.0
        expected = _trainer_log_probs(engine.model, prompt, result.token_ids)
        gaps.append((expected - torch.tensor(result.log_probs)).abs().max().item())
    assert gaps[0] < 1e-5 < 1e-1 < gaps[1], gaps  # clean before the fault step, far off from it on


# ---------------------------------------------------------------- Ray server


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    saved = dict(os.environ)  # ray.init sets RAY_* variables here; later launches must not inherit them
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def _rollout_config(**overrides):
    from omegaconf import OmegaConf

    base = {"prompt_length": 128, "response_length": 24, "max_model_len": None, "seed": 0, "engine_kwargs": {}}
    return OmegaConf.create({**base, **overrides})


def test_server_batches_concurrent_requests_and_tags_version(ray_cluster, model_dir: Path) -> None:
    from verl_sat.rollout.server import HFRolloutServer

    model_config = type("ModelConfig", (), {"local_path": str(model_dir)})()
    server = (
        ray_cluster.remote(HFRolloutServer)
        .options(max_concurrency=64)
        .remote(_rollout_config(engine_kwargs={"hf": {"batch_wait_ms": 50}}), model_config, 0)
    )
    ray_cluster.get(server.update_weights.remote({}, 7))
    prompts = _prompts(model_dir, 4)
    refs = [server.generate.remote(p, {"temperature": 1.0, "logprobs": True}, f"r{i}") for i, p in enumerate(prompts)]
    outputs = ray_cluster.get(refs)
    assert all(o.extra_fields["global_steps"] == 7 for o in outputs)
    assert all(len(o.token_ids) == len(o.log_probs) > 0 for o in outputs)
    stats = ray_cluster.get(server.__ray_call__.remote(lambda self: self.batch_sizes))
    assert max(stats) > 1, f"requests were not batched: {stats}"
    ray_cluster.kill(server)


def until(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait for ``predicate`` (polled every 50 ms); a hang guard: fails naming ``what`` after ``timeout`` s."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for: {what}")
        time.sleep(0.05)


def test_server_abort_resume_and_weight_version(ray_cluster, model_dir: Path) -> None:
    from verl_sat.rollout.server import HFRolloutServer

    model_config = type("ModelConfig", (), {"local_path": str(model_dir)})()
    server = (
        ray_cluster.remote(HFRolloutServer)
        .options(max_concurrency=64)
        .remote(_rollout_config(response_length=400, prompt_length=128, max_model_len=2048), model_config, 0)
    )
    ray_cluster.get(server.update_weights.remote({}, 1))
    # never stop at EOS, so the request is still running when we abort
    ray_cluster.get(server.__ray_call__.remote(lambda self: setattr(self.engine, "eos_token_ids", set())))
    prompt = _prompts(model_dir, 1)[0]

    def count_decode_steps(self) -> None:
        """The engine polls the abort flag before every decode step: count the polls."""
        import threading

        class Counting(threading.Event):
            polls = 0

            def is_set(self) -> bool:
                Counting.polls += 1
                return super().is_set()

        self._abort = Counting()

    ray_cluster.get(server.__ray_call__.remote(count_decode_steps))
    ref = server.generate.remote(prompt, {"max_tokens": 400}, "long")
    # abort once a few tokens are out (an event, not a sleep): the request is mid-decode
    until(lambda: ray_cluster.get(server.__ray_call__.remote(lambda self: type(self._abort).polls)) >= 4, "decoding")
    ray_cluster.get(server.abort_all_requests.remote())
    partial = ray_cluster.get(ref)
    assert partial.stop_reason == "aborted"
    assert 0 < len(partial.token_ids) < 400 and partial.extra_fields["global_steps"] == 1

    # new weights (same values) at version 2, then resume from the partial tokens
    state = ray_cluster.get(server.__ray_call__.remote(lambda self: self.engine.model.state_dict()))
    ray_cluster.get(server.update_weights.remote(state, 2))

    def count_gate_waiters(self) -> None:
        """The gate abort_all_requests closed, counting the requests held at it (same state: closed)."""

        class Gate(asyncio.Event):
            waiting = 0

            async def wait(self) -> bool:
                self.waiting += 1
                try:
                    return await super().wait()
                finally:
                    self.waiting -= 1

        assert not self._gate.is_set()
        self._gate = Gate()

    ray_cluster.get(server.__ray_call__.remote(count_gate_waiters))
    batches = ray_cluster.get(server.__ray_call__.remote(lambda self: len(self.batch_sizes)))
    held = server.generate.remote(prompt + partial.token_ids, {"max_tokens": 3}, "resume")
    until(lambda: ray_cluster.get(server.__ray_call__.remote(lambda self: self._gate.waiting)) == 1, "held at the gate")
    # held: at the gate, unanswered, and no batch decoded since the abort, until resume_generation
    ready, _ = ray_cluster.wait([held], timeout=0)
    assert not ready, "requests must wait for resume_generation after an abort"
    assert ray_cluster.get(server.__ray_call__.remote(lambda self: len(self.batch_sizes))) == batches
    ray_cluster.get(server.resume_generation.remote())
    resumed = ray_cluster.get(held)
    assert len(resumed.token_ids) == 3 and resumed.extra_fields["global_steps"] == 2
    ray_cluster.kill(server)
