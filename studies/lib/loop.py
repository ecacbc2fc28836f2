"""An in-process asynchronous RL loop for many-seed studies: one Python process, no Ray.

verl's trainer on two CPU cores pays about 65 s of start-up per run (Ray, ~6 processes importing
verl, FSDP, the rollout server) and ~3.5 s per optimizer step, so a study of 50 runs of a few
hundred optimizer steps is out of reach through it. This loop runs the same pieces in one
process, with the model built once per run from the cached default assets (start-up well under a
second after the first import):

    after every n-th optimizer step: rollout <- trainer weights          (the lag n, docs/sat.md#setting)
        (``auto_lag``: after a step whose signal exceeds ``auto_target``, within [auto_min, lag],
        the rule of verl_sat.trainer.auto_lag, the same object the trainer uses)
    y ~ mu: the CPU trainer's own HF rollout engine (verl_sat.rollout.engine.HFEngine), with its
        mismatch knobs: fixed logit bias, i.i.d. logit noise, fixed router bias, router noise;
        the batch of step j+1 is drawn while step j trains (one batch in flight, as verl's
        separate_async with num_warmup_batches = 1/n), so its staleness is in [1, n]
    R(y) = the default's rule reward (verl_sat.default.reward.compute_score)
    A = verl's GRPO outcome advantage (core_algos.compute_grpo_outcome_advantage)
    log pi = the trainer's forward (R3: the rollout's routes replayed, verl_sat.routing.gates)
    loss = verl's registered policy loss (core_algos.get_policy_loss_fn), ratio against
        old = log mu                          (bypass, as the CPU default: docs/sat.md#which-log-probs), or, for a
        rollout correction (TIS, IcePop, geometric sequence rejection: verl's rollout_corr_helper),
        old = log pi_old, pi_old = the weights of the last broadcast, fixed for the sync cycle as
        in verl's decoupled mode (old_log_prob is recomputed once per global step)
    one AdamW step on the whole batch (one mini-batch per optimizer step: q is the step's, docs/sat.md#the-rule);
        with ``max_token_len``, the batch is packed into micro-batches by verl's dynamic batching
        (``rearrange_micro_batches``, as ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``) and
        the gradients accumulate over them, each loss scaled by the step's counts as verl's worker
        does (``global_batch_info``); ``sat_quantile_scope=step`` then gates every micro-batch on a
        scoring pass's q over the whole step (verl_sat.sat.step_q), ``micro_batch`` on its own q
    DPPO-TV's token mask (``dppo_tv_mask``) may be composed with the arm's loss, as a 0/1 weight
    held-out accuracy: the *trained* policy (trainer weights, no rollout mismatch) samples the
        fixed held-out problems at temperature 1 at ``eval_at`` steps and at the last step

A sample trained at optimizer step j (0-based) was drawn while step j - 1 trained, by the weights
of the last broadcast, n * floor((j - 1) / n): staleness j - n * floor((j - 1) / n), in [1, n]
(0 at the first step). Metrics use verl's names (``critic/score/mean``,
``actor/mismatch_abs_mean`` = dbar_pi, ``actor/sat_gate_rate``, ``actor/grad_norm``,
``actor/entropy``) and are written as verl's file logger does (``{"step", "data"}`` per line), so
``verl_sat.paper.report`` and the collapse sentinel read them unchanged.

What it does not exercise: verl's distributed pieces (Ray, FSDP, the v1 trainer's scheduling,
weight sync). Those are covered by the e2e tests through the real trainer.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_sat.default.heldout import HELDOUT_GREEDY_KEY, HELDOUT_KEY, heldout_problems  # noqa: F401  (one definition)

LOSS_MODES = ("sat", "sat_gspo", "vanilla", "gspo", "dppo_tv", "cispo")
SEQUENCE_LEVEL = ("sat_gspo", "gspo")
"""losses whose ratio and SAT score are GSPO's sequence ratio (docs/sat.md#sequence-level); the others: token level"""
CORRECTIONS = ("none", "tis", "icepop", "geo_rs")
QUANTILE_SCOPES = ("step", "micro_batch")
DPPO_TV_DELTA = 1e-3
"""DPPO-TV's probability threshold of the counterfactual ``study/dppo_*`` metrics (hydra_configs/algorithm/dppo.yaml)"""
ROUTING_REPLAY = ("disabled", "R3")
METRICS_FILE = "metrics.jsonl"


@dataclass
class LoopConfig:
    """One run of the loop. Field names follow verl's keys where one exists."""

    loss_mode: str = "sat_gspo"
    """a registered policy loss: sat | sat_gspo (with sat_enabled=false: vanilla | gspo, plus dbar_pi) | dppo_tv"""
    loss_agg_mode: str = "seq-mean-token-mean"
    sat_enabled: bool = True
    correction: str = "none"
    """none: ratio against log mu (bypass) | tis: verl's token TIS | icepop: verl's token rejection
    outside [1/C, C] | geo_rs: verl's geometric-mean sequence rejection; the last three with the ratio
    against log pi_old (decoupled, pi_old fixed for the sync cycle)"""
    tis_threshold: float = 2.0
    """TIS's truncation C (verl's rollout_is_threshold)"""
    rs_threshold: float = 2.0
    """the rejection corrections' upper ratio bound (verl's rollout_rs_threshold; lower = 1 / upper)"""
    routing_replay: str = "disabled"
    """disabled | R3 (the rollout's routes replayed in the trainer's forward, docs/routing_replay.md)"""
    lag: int = 1
    """optimizer steps between weight broadcasts (the paper's n)"""
    auto_lag: bool = False
    """broadcast by verl_sat.trainer.auto_lag's rule instead of every ``lag`` steps; ``lag`` is then its max"""
    auto_target: float = 0.02
    auto_min: int = 1
    auto_signal: str = "dbar_pi"
    auto_fresh: bool = True
    """only a batch drawn by the rollout's current weights can trigger (AutoLagConfig.fresh)"""
    steps: int = 200
    """optimizer steps"""
    lr: float = 4e-4
    prompts_per_step: int = 16
    rollout_n: int = 4
    """responses per prompt (the GRPO group)"""
    max_response_length: int = 8
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_ratio_c: float = 3.0
    grad_clip: float = 1.0
    logit_bias_std: float = 0.0
    """fixed per-token rollout logit offset (systematic mismatch; EngineOptions.logit_bias_std)"""
    logit_noise_std: float = 0.0
    router_bias_std: float = 0.0
    """fixed per-layer, per-expert rollout router offset (systematic routing mismatch)"""
    router_noise_std: float = 0.0
    mismatch_seed: int = 0
    """seed of the fixed biases: the same mismatch for every seed of a study"""
    seed: int = 1
    """seed of the data, the sampling and nothing else (the model starts from the assets)"""
    eval_problems: int = 0
    """held-out problems the trained policy is scored on (0: none); never drawn for training"""
    eval_samples: int = 1
    """temperature-1 samples per held-out problem"""
    eval_at: tuple[int, ...] = ()
    """optimizer steps after which the held-out accuracy is taken, besides the last one (0: before
    training, logged on step 1's row as ``eval/heldout_acc_initial``)"""
    eval_seed: int = 20261201
    """seed of the held-out set and of its sampling: the same problems and random numbers in every run"""
    sat_alpha: float = 0.9
    """the quantile level of SAT's reference q (also for the counterfactual ``study/*`` metrics)"""
    sat_quantile_scope: str = "step"
    """the tokens SAT's q is taken over: step | micro_batch (SATPolicyLossConfig.sat_quantile_scope)"""
    max_token_len: int = 0
    """token budget of one micro-batch (verl's ppo_max_token_len_per_gpu with use_dynamic_bsz); 0: the
    whole step is one micro-batch"""
    dppo_tv_mask: float = 0.0
    """> 0: DPPO-TV's token mask at this probability threshold applied to the arm's loss as a 0/1
    weight (A > 0: keep pi - mu <= delta; A < 0: keep pi - mu >= -delta); 0: none"""
    threads: int = 1

    def __post_init__(self) -> None:
        checks = {
            "loss_mode": (self.loss_mode in LOSS_MODES, f"one of {LOSS_MODES}"),
            "correction": (self.correction in CORRECTIONS, f"one of {CORRECTIONS}"),
            "routing_replay": (self.routing_replay in ROUTING_REPLAY, f"one of {ROUTING_REPLAY}"),
            "lag": (self.lag >= 1, ">= 1"),
            "steps": (self.steps >= 1, ">= 1"),
            "lr": (self.lr > 0, "> 0"),
            "prompts_per_step": (self.prompts_per_step >= 1, ">= 1"),
            "rollout_n": (self.rollout_n >= 2, ">= 2 (GRPO needs a group)"),
            "max_response_length": (self.max_response_length >= 1, ">= 1"),
            "tis_threshold": (self.tis_threshold > 1.0, "> 1"),
            "rs_threshold": (self.rs_threshold > 1.0, "> 1"),
            "eval_problems": (0 <= self.eval_problems <= 5000, "in [0, 5000] (there are 10,000 sums)"),
            "eval_samples": (self.eval_samples >= 1, ">= 1"),
            "eval_at": (all(0 <= s <= self.steps for s in self.eval_at), f"steps in [0, steps={self.steps}]"),
            "sat_alpha": (0.0 < self.sat_alpha < 1.0, "in (0, 1)"),
            "clip_ratio_c": (self.clip_ratio_c > 1.0, "> 1"),
            "sat_quantile_scope": (self.sat_quantile_scope in QUANTILE_SCOPES, f"one of {QUANTILE_SCOPES}"),
            "max_token_len": (self.max_token_len >= 0, ">= 0 (0: one micro-batch per step)"),
            "dppo_tv_mask": (0.0 <= self.dppo_tv_mask < 1.0, "in [0, 1) (a probability threshold; 0: off)"),
        }
        for name in ("logit_bias_std", "logit_noise_std", "router_bias_std", "router_noise_std"):
            checks[name] = (getattr(self, name) >= 0, ">= 0")
        for name, (ok, want) in checks.items():
            if not ok:
                raise ValueError(f"LoopConfig.{name} must be {want}, got {getattr(self, name)!r}")
        if self.auto_lag:
            self.auto_lag_config()

    def auto_lag_config(self) -> Any:
        """The trainer's ``AutoLagConfig`` of this loop's auto_* fields (``lag`` is its max)."""
        from verl_sat.trainer.auto_lag import AutoLagConfig

        return AutoLagConfig(
            target=self.auto_target, min=self.auto_min, max=self.lag, signal=self.auto_signal, fresh=self.auto_fresh
        )


@dataclass
class Batch:
    """One optimizer step's samples, right-padded: prompt + response per row."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, R) float
    response_ids: torch.Tensor  # (B, R)
    rollout_log_prob: torch.Tensor  # (B, R) log mu
    prompt_len: torch.Tensor  # (B,)
    scores: torch.Tensor  # (B,)
    index: np.ndarray  # (B,) the prompt's group id
    routes: list[torch.Tensor] | None  # per row [n_i, L, k] (R3)
    version: int = 0  # the weight version (optimizer steps) of the rollout that drew it


def actor_config(cfg: LoopConfig) -> Any:
    """The ActorConfig verl's worker would build for this arm (the losses read clip radii from it)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    from verl_sat import SATPolicyLossConfig

    if cfg.loss_mode in ("sat", "sat_gspo"):
        policy_loss = SATPolicyLossConfig(
            loss_mode=cfg.loss_mode,
            sat_enabled=cfg.sat_enabled,
            sat_alpha=cfg.sat_alpha,
            sat_quantile_scope=cfg.sat_quantile_scope,
        )
    else:
        policy_loss = PolicyLossConfig(loss_mode=cfg.loss_mode)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=cfg.rollout_n,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=cfg.eps_high,
        clip_ratio_low=cfg.eps_low,
        clip_ratio_high=cfg.eps_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        policy_loss=policy_loss,
    )


def rollout_correction(
    cfg: LoopConfig, old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, response mask after rejection, metrics) from verl's rollout_corr_helper,
    on the behaviour log-ratio log pi_old - log mu (algorithm.rollout_correction in decoupled mode).

    tis:    w = min(exp(log pi_old - log mu), C)                       rollout_is=token
    icepop: tokens with exp(log pi_old - log mu) outside [1/C, C] get no gradient  rollout_rs=token_k1
    geo_rs: responses with exp(mean_t (log pi_old - log mu)) outside [1/C, C] dropped  rollout_rs=seq_mean_k1
    """
    from verl.trainer.ppo import rollout_corr_helper as rc

    log_ratio = old - mu
    if cfg.correction == "tis":
        weights, metrics = rc.compute_rollout_correction_weights(
            log_ratio, mask, rollout_is="token", rollout_is_threshold=cfg.tis_threshold
        )
        return weights, mask, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
    level = {"icepop": "token_k1", "geo_rs": "seq_mean_k1"}[cfg.correction]
    kept, metrics = rc.compute_rollout_rejection_mask(
        log_ratio, mask, rollout_rs=level, rollout_rs_threshold=cfg.rs_threshold
    )
    return None, kept, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def sat_activity(
    cfg: LoopConfig,
    log_prob: torch.Tensor,
    old: torch.Tensor,
    mu: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """Where SAT would act on this batch, for every arm (SAT on or off): ``study/*`` metrics.

    d = log pi - log mu (token), or GSPO's mean_t d broadcast to the response (docs/sat.md#sequence-level); the
    ratio r = exp(log pi - log old) as the arm's loss forms it (token or sequence);
    q = alpha-quantile of |d| over T_act; gated = 1{q > 0, |d| > q} (docs/sat.md#the-rule, steps 1-5);
    intercepted = tokens in {A > 0, 1 + eps_high~ < r < 1 + eps_high} or its mirror.
    SAT can change an update only through intercepted tokens, which need q < log(1 + eps_high)
    for the positive side: ``study/q_below_radius`` says whether it is.
    """
    from verl_sat.sat.losses import masked_mean
    from verl_sat.sat.rule import intercepted, sat_factors

    d, log_r = log_prob - mu, log_prob - old
    if cfg.loss_mode in SEQUENCE_LEVEL:
        d, log_r = (_sequence_mean(x, mask).expand_as(x) for x in (d, log_r))
    n = float(mask.sum())
    if n == 0:
        return {}
    f = sat_factors(d, mask, cfg.sat_alpha, "hill", 2.0)
    band = intercepted(torch.exp(log_r), advantages, f, cfg.eps_low, cfg.eps_high)
    q = float(f.q)
    dppo_masked = (dppo_tv_valid(log_prob, mu, advantages, DPPO_TV_DELTA) == 0) & mask.bool()
    both = intercepted_tokens(torch.exp(log_r), advantages, f, cfg.eps_low, cfg.eps_high) & dppo_masked
    return {
        "study/q": q,
        "study/q_below_radius": float(q < math.log1p(cfg.eps_high)),
        "study/gate_rate": f.idx.numel() / n,
        "study/intercepted_frac": float(band) / n,
        "study/abs_d_mean": float(masked_mean(d.abs(), mask)),
        "study/dppo_masked_frac": float(dppo_masked.sum()) / n,
        "study/dppo_intercepted_overlap_frac": float(both.sum()) / n,
    }


def intercepted_tokens(
    ratio: torch.Tensor, advantages: torch.Tensor, f: Any, eps_low: float, eps_high: float
) -> torch.Tensor:
    """The (B, R) bool mask of the tokens ``verl_sat.sat.rule.intercepted`` counts (clipped by SAT, not by PPO):
    {A > 0, 1 + eps_high~ < r < 1 + eps_high} or {A < 0, 1 - eps_low < r < 1 - eps_low~}, at the gated tokens."""
    from verl_sat.sat.rule import gated_bounds

    r = ratio.detach().reshape(-1)[f.idx]
    lower_g, upper_g = (bound.to(r.dtype) for bound in gated_bounds(f, eps_low, eps_high))
    adv = advantages.reshape(-1)[f.idx]
    band = ((adv > 0) & (r > upper_g) & (r < 1.0 + eps_high)) | ((adv < 0) & (r < lower_g) & (r > 1.0 - eps_low))
    out = torch.zeros(ratio.numel(), dtype=torch.bool)
    out[f.idx] = band
    return out.reshape(ratio.shape)


def dppo_tv_valid(log_prob: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, delta: float) -> torch.Tensor:
    """DPPO-TV's detached 0/1 token mask (the paper's binary-TV trust region; verl's ``dppo_tv`` loss):
    A > 0: 1{pi - pi_old <= delta};  A <= 0: 1{pi - pi_old >= -delta}."""
    change = torch.exp(log_prob.detach()) - torch.exp(old.detach())
    return torch.where(advantages > 0, change <= delta, change >= -delta).float()


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) masked mean over each response (GSPO's length-normalised sequence log-ratio)."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)


def load_assets(assets_dir: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) from the default's cached assets (``verl_sat.default.assets.build_assets_once``)."""
    from transformers import AutoTokenizer

    from verl_sat.rollout.engine import load_model

    path = str(Path(assets_dir) / "model")
    return load_model(path), AutoTokenizer.from_pretrained(path)


class StudyLoop:
    """Trainer + lagged rollout for one :class:`LoopConfig`; ``run()`` returns the per-step rows."""

    def __init__(self, cfg: LoopConfig, model: Any, tokenizer: Any) -> None:
        import copy

        from verl.trainer.ppo import core_algos

        from verl_sat.rollout.engine import EngineOptions, HFEngine

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.policy = copy.deepcopy(model).train()
        options = EngineOptions(
            logit_noise_std=cfg.logit_noise_std,
            logit_bias_std=cfg.logit_bias_std,
            router_noise_std=cfg.router_noise_std,
            router_bias_std=cfg.router_bias_std,
            seed=cfg.mismatch_seed,
        )
        self.rollout = HFEngine.from_model(copy.deepcopy(model).eval(), tokenizer, options)
        self.rollout.generator.manual_seed(cfg.seed)  # sampling: per seed; the biases: per mismatch_seed
        self.rollout.record_routes = cfg.routing_replay == "R3"
        self.pad_id = self.rollout.pad_token_id
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.actor_config = actor_config(cfg)
        self.loss_fn = core_algos.get_policy_loss_fn(cfg.loss_mode)
        self.rng = random.Random(cfg.seed)
        self.version = 0
        # pi_old of the decoupled corrections: the weights of the last broadcast, for the whole cycle
        self.old_policy = copy.deepcopy(model).eval() if cfg.correction != "none" else None
        self.heldout = heldout_problems(cfg.eval_problems, cfg.eval_seed)
        self._heldout_pairs = {(p.a, p.b) for p in self.heldout}
        self.eos = self.rollout.eos_token_ids

    # -- rollout -------------------------------------------------------------------------------
    def sync_weights(self, version: int) -> None:
        """The weight broadcast: the rollout (and pi_old) take the trainer's weights of ``version``."""
        state = self.policy.state_dict()
        self.rollout.model.load_state_dict(state)
        if self.old_policy is not None:
            self.old_policy.load_state_dict(state)
        self.version = version

    def generate(self) -> Batch:
        """``prompts_per_step`` fresh problems x ``rollout_n`` responses from the rollout (mu)."""
        from verl_sat.default import data as task
        from verl_sat.default.reward import compute_score
        from verl_sat.rollout.engine import GenerationRequest
        from verl_sat.rollout.sampling import SamplingParams

        cfg = self.cfg
        problems = [self._training_problem(task) for _ in range(cfg.prompts_per_step)]
        prompts = [task.prompt_ids(self.tokenizer, p) for p in problems]
        params = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0)
        requests = [
            GenerationRequest(prompt, params, cfg.max_response_length)
            for prompt in prompts
            for _ in range(cfg.rollout_n)
        ]
        results = self.rollout.generate_batch(requests)
        texts = self.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
        answers = [p.answer for p in problems for _ in range(cfg.rollout_n)]
        scores = torch.tensor([compute_score(None, t, a) for t, a in zip(texts, answers, strict=True)])
        index = np.repeat(np.arange(cfg.prompts_per_step), cfg.rollout_n)
        return self._pack([r.prompt_ids for r in requests], results, scores, index)

    def _training_problem(self, task: Any) -> Any:
        """A fresh training problem, never one of the held-out set."""
        while True:
            problem = task.sample_problem(self.rng)
            if (problem.a, problem.b) not in self._heldout_pairs:
                return problem

    def _pack(self, prompts: list[list[int]], results: list[Any], scores: torch.Tensor, index: np.ndarray) -> Batch:
        width = max(len(p) + len(r.token_ids) for p, r in zip(prompts, results, strict=True))
        resp_width = self.cfg.max_response_length
        batch = len(prompts)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        resp_ids = torch.full((batch, resp_width), self.pad_id, dtype=torch.long)
        resp_mask = torch.zeros((batch, resp_width))
        mu = torch.zeros((batch, resp_width))
        for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            seq = prompt + result.token_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            n = len(result.token_ids)
            resp_ids[row, :n] = torch.tensor(result.token_ids, dtype=torch.long)
            resp_mask[row, :n] = 1.0
            mu[row, :n] = torch.tensor(result.log_probs)
        routes = None
        if self.cfg.routing_replay == "R3":
            routes = [torch.as_tensor(r.routed_experts) for r in results]
        prompt_len = torch.tensor([len(p) for p in prompts])
        return Batch(ids, mask, resp_mask, resp_ids, mu, prompt_len, scores, index, routes, self.version)

    # -- trainer -------------------------------------------------------------------------------
    def log_probs(self, batch: Batch, model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi (B, R), token entropy (B, R)) of the response tokens under ``model``'s weights
        (default: the trainer's)."""
        from verl_sat.routing.gates import replay_routes

        model = self.policy if model is None else model
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": positions}
        if batch.routes is not None:
            with replay_routes(model, batch.routes, batch.attention_mask):
                logits = model(**kwargs).logits
        else:
            logits = model(**kwargs).logits
        # response token t of row b sits at prompt_len_b + t; its logits at prompt_len_b + t - 1
        resp = batch.response_ids.shape[1]
        at = (batch.prompt_len[:, None] - 1 + torch.arange(resp)[None, :]).clamp(max=logits.shape[1] - 1)
        picked = logits.gather(1, at[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        log_softmax = torch.log_softmax(picked, dim=-1)
        log_prob = log_softmax.gather(-1, batch.response_ids[:, :, None]).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        return log_prob * batch.response_mask, entropy.detach()

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch`` with the arm's registered loss; returns verl-named metrics."""
        from verl.trainer.ppo import core_algos

        from verl_sat.sat.losses import loss_context

        cfg, mask = self.cfg, batch.response_mask
        rewards = torch.zeros_like(mask)
        last = (mask.sum(-1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] = batch.scores.float()
        advantages, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, batch.index)
        if cfg.max_token_len > 0:
            return self._update_packed(batch, advantages)
        log_prob, entropy = self.log_probs(batch)
        mu = batch.rollout_log_prob
        old, weights, metrics = mu, None, {}
        if cfg.correction != "none":
            with torch.no_grad():  # pi_old: the last broadcast's weights (verl's decoupled old_log_prob)
                old = self.log_probs(batch, self.old_policy)[0]
            weights, mask, corr_metrics = rollout_correction(cfg, old, mu, mask)
            metrics.update(corr_metrics)
        metrics.update(sat_activity(cfg, log_prob.detach(), old, mu, advantages, batch.response_mask))
        weights = self._dppo_weights(log_prob, old, advantages, mask, weights, metrics)
        with loss_context(rollout_log_prob=mu, whole_step=True):
            loss, loss_metrics = self.loss_fn(
                old, log_prob, advantages, mask, cfg.loss_agg_mode, self.actor_config, weights
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics.update({k: float(v) for k, v in loss_metrics.items() if _scalar(v)})
        return self._step(batch, log_prob.detach(), entropy, float(loss.detach()), metrics)

    def _dppo_weights(
        self,
        log_prob: torch.Tensor,
        old: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        metrics: dict[str, float],
    ) -> torch.Tensor | None:
        """The loss's token weights with DPPO-TV's mask composed in (``dppo_tv_mask``), else unchanged."""
        if self.cfg.dppo_tv_mask <= 0:
            return weights
        valid = dppo_tv_valid(log_prob, old, advantages, self.cfg.dppo_tv_mask)
        n = float(mask.sum())
        metrics["study/dppo_arm_masked_frac"] = float(((1.0 - valid) * mask).sum()) / n if n else 0.0
        return valid if weights is None else weights * valid

    def micro_batches(self, batch: Batch) -> list[list[int]]:
        """Row indices per micro-batch: verl's dynamic batching by ``max_token_len`` tokens
        (``seqlen_balancing.rearrange_micro_batches``, what ``use_dynamic_bsz`` runs); one for 0."""
        if self.cfg.max_token_len <= 0:
            return [list(range(batch.input_ids.shape[0]))]
        from tensordict import TensorDict
        from verl.utils.seqlen_balancing import rearrange_micro_batches

        rows = TensorDict(
            {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask},
            batch_size=[batch.input_ids.shape[0]],
        )
        _, index = rearrange_micro_batches(rows, self.cfg.max_token_len)
        return [list(map(int, part)) for part in index]

    def _update_packed(self, batch: Batch, advantages: torch.Tensor) -> dict[str, float]:
        """The step as gradient accumulation over packed micro-batches (``max_token_len``): the arm's
        loss is called once per micro-batch on its rows, scaled by the step's token and response
        counts (verl's ``global_batch_info``), and the sum is backpropagated once. The rows'
        log-probs come from one forward over the step, whose rows do not see each other (the same
        log-probs as a forward per micro-batch, up to float: tests/test_study_loop_packing_on_cpu.py).
        ``sat_quantile_scope=step`` gates every micro-batch on the step's q over that forward's
        score (verl_sat.sat.step_q, as verl-sat's worker does); ``micro_batch`` each on its own q."""
        from verl_sat.sat.losses import loss_context
        from verl_sat.sat.quantile import exact_quantile
        from verl_sat.sat.step_q import needs_step_q, step_scores

        cfg, mask, mu = self.cfg, batch.response_mask, batch.rollout_log_prob
        log_prob, entropy = self.log_probs(batch)
        score = log_prob.detach()  # the step's score at this step's weights (no update inside a step)
        old, weights, metrics = mu, None, {}
        if cfg.correction != "none":
            with torch.no_grad():
                old = self.log_probs(batch, self.old_policy)[0]
            weights, mask, corr_metrics = rollout_correction(cfg, old, mu, mask)
            metrics.update(corr_metrics)
        metrics.update(sat_activity(cfg, score, old, mu, advantages, batch.response_mask))
        weights = self._dppo_weights(score, old, advantages, mask, weights, metrics)
        step_q = None
        if needs_step_q(self.actor_config):
            values, counts = step_scores(cfg.loss_mode, score, old, mask)
            step_q = float(exact_quantile(values, cfg.sat_alpha, counts))
        self.actor_config.global_batch_info.update(  # in place, as verl's ppo_loss fills it
            {
                "dp_size": 1,
                "batch_num_tokens": int(mask.sum()),
                "global_batch_size": int((mask.sum(-1) > 0).sum()),
                "loss_scale_factor": None,
            }
        )
        parts = self.micro_batches(batch)
        total, sums, gated, starved, active = 0.0, {}, 0.0, 0, 0
        try:
            for rows in parts:
                index = torch.tensor(rows, dtype=torch.long)
                w = None if weights is None else weights[index]
                scored = score[index] if step_q is not None else None
                with loss_context(rollout_log_prob=mu[index], step_q=step_q, score_log_prob=scored):
                    loss, loss_metrics = self.loss_fn(
                        old[index],
                        log_prob[index],
                        advantages[index],
                        mask[index],
                        cfg.loss_agg_mode,
                        self.actor_config,
                        w,
                    )
                total = total + loss
                for k, v in loss_metrics.items():
                    if _scalar(v):
                        sums[k] = sums.get(k, 0.0) + float(v)
                n = float(mask[index].sum())
                if n > 0 and "actor/sat_gate_rate" in loss_metrics:
                    active += 1
                    gated += float(loss_metrics["actor/sat_gate_rate"]) * n
                    starved += float(loss_metrics["actor/sat_gate_rate"]) == 0.0
        finally:
            self.actor_config.global_batch_info.clear()
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        metrics.update({k: v / len(parts) for k, v in sums.items()})
        sizes = [len(rows) for rows in parts]
        metrics.update(
            {
                "study/micro_batches": float(len(parts)),
                "study/seqs_per_micro_batch_min": float(min(sizes)),
                "study/seqs_per_micro_batch_max": float(max(sizes)),
                "study/seqs_per_micro_batch_mean": sum(sizes) / len(sizes),
            }
        )
        if active:  # the gate the SAT loss applied, over its micro-batches (SAT enabled only)
            metrics["study/mb_gate_rate"] = gated / float(mask.sum())
            metrics["study/mb_starved_frac"] = starved / active
        return self._step(batch, score, entropy, float(total.detach()), metrics)

    def _step(
        self, batch: Batch, log_prob: torch.Tensor, entropy: torch.Tensor, loss: float, metrics: dict[str, float]
    ) -> dict[str, float]:
        """Clip the accumulated gradient, step AdamW unless its norm is non-finite (verl's actor), and log."""
        from verl_sat.sat.losses import masked_mean

        cfg, mu = self.cfg, batch.rollout_log_prob
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # verl's actor skips the step on a non-finite gradient norm
            self.optimizer.step()
        metrics.update(
            {
                "critic/score/mean": float(batch.scores.float().mean()),
                "actor/mismatch_abs_mean": float(masked_mean((log_prob - mu).abs(), batch.response_mask)),
                "actor/entropy": float(masked_mean(entropy, batch.response_mask)),
                "actor/grad_norm": float(grad_norm) if finite else math.inf,
                "actor/pg_loss": loss,
                "response_length/mean": float(batch.response_mask.sum(-1).mean()),
            }
        )
        return metrics

    # -- the trained policy on the held-out set ----------------------------------------------
    def heldout_accuracy(self) -> dict[str, float]:
        """The trainer's policy (no rollout mismatch) on the held-out problems: accuracy of
        ``eval_samples`` temperature-1 samples each, and of greedy decoding, with the same random
        numbers in every run and at every step (``eval_seed``; ``verl_sat.default.heldout``, the
        product's definition too)."""
        from verl_sat.default.heldout import heldout_accuracy

        self.policy.eval()
        try:
            return heldout_accuracy(
                self.policy,
                self.tokenizer,
                self.heldout,
                self.cfg.eval_samples,
                self.cfg.eval_seed,
                self.cfg.max_response_length,
            )
        finally:
            self.policy.train()

    def _eval_due(self, step: int) -> bool:
        return self.cfg.eval_problems > 0 and (step in self.cfg.eval_at or step == self.cfg.steps)

    def run(self, out_dir: str | Path | None = None, method: str | None = None) -> list[dict[str, Any]]:
        """``cfg.steps`` optimizer steps; returns ``[{"step", **metrics}]``. With ``out_dir``, also
        writes metrics.jsonl, loop_config.json and run.json (``method``, ``lag``: report.py's keys)."""
        rows: list[dict[str, Any]] = []
        sink = None
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "loop_config.json").write_text(json.dumps(asdict(self.cfg), indent=2))
            meta = {"method": method or self.cfg.loss_mode, "lag": "auto" if self.cfg.auto_lag else self.cfg.lag}
            meta["name"] = out.name
            if self.cfg.auto_lag:
                meta["auto_lag"] = dict(self.cfg.auto_lag_config().__dict__)
            (out / "run.json").write_text(json.dumps(meta, indent=2))
            sink = (out / METRICS_FILE).open("w")
        from verl_sat.trainer.auto_lag import BROADCAST_KEY, AutoLag, signal_of

        lag = self.cfg.lag
        gate = AutoLag(self.cfg.auto_lag_config()) if self.cfg.auto_lag else None
        try:
            initial = self.heldout_accuracy() if self.cfg.eval_problems > 0 and 0 in self.cfg.eval_at else {}
            self.sync_weights(0)
            pending = self.generate()
            for step in range(self.cfg.steps):
                start = time.perf_counter()
                # step's batch was drawn while the previous step trained (one batch in flight)
                batch, pending = pending, (self.generate() if step + 1 < self.cfg.steps else None)
                gen_s = time.perf_counter() - start
                metrics = self.update(batch)
                if gate is None:
                    broadcast = (step + 1) % lag == 0  # the broadcast after every n-th optimizer step
                    metrics[BROADCAST_KEY] = float(broadcast)
                else:  # sat.lag=auto: the trainer's rule on this step's signal
                    signal = signal_of(metrics, gate.config)
                    broadcast, k = gate.decide(signal, fresh=batch.version >= self.version)
                    metrics.update(gate.step_metrics(broadcast, k, signal))
                if broadcast:
                    self.sync_weights(step + 1)
                metrics["training/sat/staleness_steps/max"] = float(step - batch.version)
                metrics["timing_s/gen"] = gen_s
                if self._eval_due(step + 1):
                    metrics.update(self.heldout_accuracy())
                if step == 0:
                    metrics.update({f"{k}_initial": v for k, v in initial.items()})
                metrics["timing_s/step"] = time.perf_counter() - start
                rows.append({"step": step + 1, **metrics})
                if sink is not None:
                    sink.write(json.dumps({"step": step + 1, "data": metrics}) + "\n")
                    sink.flush()
        finally:
            if sink is not None:
                sink.close()
        return rows


def _rows(batch: Batch, rows: list[int]) -> Batch:
    """The micro-batch of ``batch`` holding ``rows`` (R3's routes included), in that order."""
    index = torch.tensor(rows, dtype=torch.long)
    routes = None if batch.routes is None else [batch.routes[i] for i in rows]
    return Batch(
        batch.input_ids[index],
        batch.attention_mask[index],
        batch.response_mask[index],
        batch.response_ids[index],
        batch.rollout_log_prob[index],
        batch.prompt_len[index],
        batch.scores[index],
        batch.index[rows],
        routes,
        batch.version,
    )


def _scalar(value: Any) -> bool:
    return isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1)
