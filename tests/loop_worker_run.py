"""Worker script of tests/test_loop_worker_equivalence_on_cpu.py: one optimizer step, two ways.

It initialises torch.distributed (gloo, world size 1) and verl's CPU platform, which must not leak
into the test session, so the test runs it as a subprocess and reads the JSON it writes.
``python tests/loop_worker_run.py MODEL_DIR OUT_JSON``: draws one batch from the study loop's
rollout (a fixed logit and router bias, routes recorded for R3), then, for each arm, takes one
optimizer step on that batch

- in the study loop (``studies.lib.loop.StudyLoop.update``), and
- through the product's actor worker: verl's ``ActorRolloutRefWorker`` under ``AsyncSATActor``
  (``sat_ppo_loss``, the composed FSDP2 engine with R3 replay and the step's q), built by verl's
  own ``init_model`` from the composed ``sat_gspo_cpu`` config with ``sat.*`` mapped by
  ``verl_sat.trainer.recipe.resolve``, fed as verl's driver feeds ``update_actor``
  (``left_right_2_no_padding``; bypass: old_log_probs = rollout_log_probs; decoupled TIS:
  verl's ``compute_rollout_correction_and_add_to_batch``),

from the same weights, and writes both sides' loss, SAT metrics, gradients (after clipping, as
the optimizer sees them) and parameters after the step.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl's FSDP engine is registered under cuda
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl  # noqa: E402, F401  (loads verl-sat's plugin: the CPU platform, the hf rollout, the losses)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the studies' shared code: studies.lib
from studies.lib.loop import Batch, LoopConfig, StudyLoop, sat_activity  # noqa: E402

PROMPTS, N, RESPONSE = 4, 4, 8  # one optimizer step: 16 responses of up to 8 tokens
LR, MISMATCH_SEED = 4e-4, 7
# The arms: name -> (LoopConfig overrides, Hydra overrides of the product's config).
ARMS = {
    "sat_gspo": ({"loss_mode": "sat_gspo"}, ["algorithm=sat_gspo"]),
    "gspo": ({"loss_mode": "gspo", "sat_enabled": False}, ["algorithm=gspo"]),
    "sat_grpo": ({"loss_mode": "sat", "loss_agg_mode": "token-mean"}, ["algorithm=sat_grpo"]),
    "gspo_tis": (
        {"loss_mode": "gspo", "sat_enabled": False, "correction": "tis"},
        ["algorithm=gspo", "+stabilizer=tis"],
    ),
}
STALENESS = 1.0  # what the product's trainer would write as sat_staleness (one step behind)


def loop_config(**overrides) -> LoopConfig:
    settings = dict(
        prompts_per_step=PROMPTS,
        rollout_n=N,
        max_response_length=RESPONSE,
        routing_replay="R3",
        lr=LR,
        logit_bias_std=0.14,  # with seed 8: SAT-GSPO and SAT-GRPO both gate and intercept on the batch
        router_bias_std=1.0,  # a routing mismatch that R3 removes (the rollout's routes are replayed)
        mismatch_seed=MISMATCH_SEED,
        seed=8,
    )
    return LoopConfig(**{**settings, **overrides})


def draw_batch(model, tokenizer) -> Batch:
    """One batch from the loop's rollout (mu: logit and router bias, routes recorded). An untrained
    model never answers right, so the scores are set: 1 for the responses above their group's median
    log-ratio mean_t (log pi - log mu), which puts SAT's gated responses in its band (A > 0, r > 1)."""
    loop = StudyLoop(loop_config(), model, tokenizer)
    batch = loop.generate()
    with torch.no_grad():
        log_prob = loop.log_probs(batch)[0]
    mask = batch.response_mask
    seq = (((log_prob - batch.rollout_log_prob) * mask).sum(-1) / mask.sum(-1)).view(-1, N)
    batch.scores = (seq > seq.median(dim=1, keepdim=True).values).float().view(-1)
    return batch


def perturbed(model, scale: float = 0.02, seed: int = 11):
    """pi_old of the decoupled arm: the weights of an earlier version (here: the model plus noise)."""
    old = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return old.eval()


# ---------------------------------------------------------------------------------------------
# the loop's side
# ---------------------------------------------------------------------------------------------
def loop_step(cfg: LoopConfig, model, tokenizer, batch: Batch, old_model) -> dict:
    loop = StudyLoop(cfg, model, tokenizer)
    if loop.old_policy is not None:
        loop.old_policy = old_model
    with torch.no_grad():
        log_prob = loop.log_probs(batch)[0]
        old = loop.log_probs(batch, old_model)[0] if cfg.correction != "none" else batch.rollout_log_prob
    metrics = loop.update(batch)
    grads = {n: p.grad.detach().clone() for n, p in loop.policy.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in loop.policy.named_parameters()}
    return {"metrics": metrics, "grads": grads, "params": params, "log_prob": log_prob, "old": old}


# ---------------------------------------------------------------------------------------------
# the product's side
# ---------------------------------------------------------------------------------------------
def product_config(model_dir: str, overrides: list[str]):
    """The composed CPU default with this arm's groups, ``sat.*`` mapped onto verl's keys as ``verl-sat`` does."""
    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir
    from verl_sat.trainer.recipe import resolve

    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "sat.default_assets=false",
        "sat.lag=1",
        "trainer.v1.trainer_mode=sync",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",  # the step is the whole batch
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}",  # one micro-batch, as the default
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={PROMPTS * N}",
        f"actor_rollout_ref.actor.optim.lr={LR}",
    ]
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name="sat_gspo_cpu", overrides=[*base, *overrides, "sat.routing_replay=R3"])
    resolve(cfg)  # what verl_sat.main.prepare does to the composed config before verl reads it
    return cfg


def build_worker(cfg):
    """verl's actor worker class under AsyncSATActor (what ``sat_worker_class`` hands Ray), in-process."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_sat.trainer.actor import AsyncSATActor

    cls = type("SATActorRolloutRefWorker", (AsyncSATActor, ActorRolloutRefWorker), {})
    worker = cls(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def verl_layout(batch: Batch, pad_id: int) -> dict[str, torch.Tensor]:
    """The loop's right-padded rows in verl's layout: left-padded prompts, right-padded responses;
    routes aligned with input_ids (the last token, never fed to the rollout, has none: zeros)."""
    rows, width = batch.input_ids.shape[0], int(batch.prompt_len.max())
    resp = batch.response_ids.shape[1]
    prompts = torch.full((rows, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)
    routes = None
    if batch.routes is not None:
        layers, k = batch.routes[0].shape[1:]
        routes = torch.zeros((rows, width + resp, layers, k), dtype=torch.long)
    response_mask = batch.response_mask.long()
    for i in range(rows):
        p = int(batch.prompt_len[i])
        prompts[i, width - p :] = batch.input_ids[i, :p]
        prompt_mask[i, width - p :] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    for i in range(rows):
        if routes is not None:
            real = attention_mask[i].nonzero().squeeze(-1)
            r = batch.routes[i]
            routes[i, real[: r.shape[0]]] = r.long()
    out = {
        "prompts": prompts,
        "responses": batch.response_ids.clone(),
        "input_ids": torch.cat([prompts, batch.response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }
    if routes is not None:
        out["routed_experts"] = routes
    return out


def grpo_advantages(batch: Batch) -> torch.Tensor:
    """verl's GRPO outcome advantage, the score on each response's last token (as the driver does)."""
    from verl.trainer.ppo import core_algos

    mask = batch.response_mask
    rewards = torch.zeros_like(mask)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(last)), last] = batch.scores.float()
    return core_algos.compute_grpo_outcome_advantage(rewards, mask, np.asarray(batch.index))[0]


def worker_step(cfg, batch: Batch, pad_id: int, old_log_probs: torch.Tensor) -> dict:
    """verl's driver side (ray_trainer._update_actor) then ``update_actor`` on the in-process worker."""
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from verl_sat.trainer.actor import STALENESS_FIELD, finish_staleness_breakdown

    worker = build_worker(cfg)
    engine = worker.actor.engine
    rows = len(batch.scores)
    fields = verl_layout(batch, pad_id)
    fields["rollout_log_probs"] = batch.rollout_log_prob.clone()
    fields["advantages"] = grpo_advantages(batch)
    fields[STALENESS_FIELD] = torch.full((rows,), STALENESS)
    corr, corr_metrics = cfg.algorithm.rollout_correction, {}
    if corr.bypass_mode:  # verl's bypass: the ratio against the rollout's own log-probs
        fields["old_log_probs"] = fields["rollout_log_probs"].clone()
    else:  # decoupled: pi_old's log-probs, then verl's IS weights / rejection on the driver
        fields["old_log_probs"] = old_log_probs.clone()
        data = DataProto.from_dict(tensors=dict(fields))
        data, corr_metrics = compute_rollout_correction_and_add_to_batch(data, corr)  # as the v1 trainer calls it
        fields = {k: data.batch[k] for k in data.batch.keys()}
    td = left_right_2_no_padding(TensorDict(fields, batch_size=rows))
    actor = cfg.actor_rollout_ref.actor
    mini = int(actor.ppo_mini_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
    assert mini == rows, (mini, rows)
    tu.assign_non_tensor(
        td,
        calculate_entropy=bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=int(actor.ppo_epochs),
        seed=int(actor.data_loader_seed),
        dataloader_kwargs={"shuffle": bool(actor.shuffle)},
        compute_loss=True,
        temperature=float(cfg.actor_rollout_ref.rollout.temperature),
    )
    names = {id(p): n for n, p in engine.module.named_parameters()}
    captured: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):  # after clipping, before the update: the step's gradients
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    captured[names[id(p)]] = _full(p.grad).detach().clone()

    handle = engine.optimizer.register_step_pre_hook(capture)
    # the worker's own forward first (compute_log_prob: R3 replay, no update), for the diagnostics
    infer = td.clone()
    tu.assign_non_tensor(infer, calculate_entropy=False, compute_loss=False)
    log_prob = no_padding_2_padding(worker.compute_log_prob(infer)["log_probs"], infer).detach()
    output = worker.update_actor(td)
    handle.remove()
    metrics = _reduce(tu.get(output, "metrics"))
    finish_staleness_breakdown(metrics)
    metrics.update({k: float(v) for k, v in corr_metrics.items()})  # the driver's, as the trainer logs them
    params = {n: _full(p).detach().clone() for n, p in engine.module.named_parameters()}
    settings = optimizer_settings(engine.optimizer)
    return {"metrics": metrics, "grads": captured, "params": params, "log_prob": log_prob, "optim": settings}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reduce(metrics: dict) -> dict[str, float]:
    """verl's driver reduction of the worker's metrics (``reduce_metrics`` after ``Metric.aggregate_dp``)."""
    from verl.utils.metric import reduce_metrics

    return {k: float(v) for k, v in reduce_metrics(dict(metrics)).items() if np.isscalar(v) or np.size(v) == 1}


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------
def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |a - b| over every tensor, the largest |a| (the scale), and their ratio."""
    if a.keys() != b.keys():
        raise KeyError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    abs_diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(a[k].abs().max()) for k in a)
    return {"max_abs": abs_diff, "scale": scale, "rel": abs_diff / scale if scale else 0.0}


def loop_optimizer_on(cfg: LoopConfig, model, tokenizer, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters after the loop's own optimizer (as StudyLoop builds it) takes one step on ``grads``."""
    loop = StudyLoop(cfg, model, tokenizer)
    for name, p in loop.policy.named_parameters():
        p.grad = grads[name].clone()
    loop.optimizer.step()
    return {n: p.detach().clone() for n, p in loop.policy.named_parameters()}


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict:
    group = optimizer.param_groups[0]
    return {k: list(group[k]) if k == "betas" else float(group[k]) for k in ("lr", "betas", "eps", "weight_decay")}


def compare(name: str, model_dir: str, model, tokenizer, batch: Batch, old_model, weight_decay: float | None) -> dict:
    """One arm: the loop's step and the worker's on ``batch``; ``weight_decay`` None: the product's default."""
    loop_overrides, hydra_overrides = ARMS[name]
    cfg = loop_config(**loop_overrides)
    loop = loop_step(cfg, model, tokenizer, batch, old_model)
    if weight_decay is not None:
        hydra_overrides = [*hydra_overrides, f"actor_rollout_ref.actor.optim.weight_decay={weight_decay}"]
    product = product_config(model_dir, hydra_overrides)
    worker = worker_step(product, batch, tokenizer.pad_token_id, loop["old"])
    mask = batch.response_mask
    # the loop's study/* diagnostics, recomputed on the worker's forward (its compute_log_prob)
    on_worker = sat_activity(
        cfg, worker["log_prob"] * mask, loop["old"], batch.rollout_log_prob, grpo_advantages(batch), mask
    )
    initial = {n: p.detach() for n, p in model.named_parameters()}
    replayed = loop_optimizer_on(cfg, model, tokenizer, worker["grads"])
    lm = loop["metrics"]
    return {
        "loop": {k: v for k, v in lm.items() if isinstance(v, float)},
        "worker": worker["metrics"],
        "loop_study_on_worker_forward": on_worker,
        "log_prob": {"max_abs": float(((worker["log_prob"] - loop["log_prob"]) * mask).abs().max())},
        "grads": max_diff(loop["grads"], worker["grads"]),
        "params": max_diff(loop["params"], worker["params"]),
        # the loop's optimizer on the worker's gradients against the worker's optimizer on them
        "optimizer": max_diff(replayed, worker["params"]),
        # what is left once the product's decoupled weight decay, p <- p (1 - lr wd), is taken out
        "optimizer_minus_decay": max_diff(
            replayed,
            {k: worker["params"][k] + LR * worker["optim"]["weight_decay"] * initial[k] for k in initial},
        ),
        "worker_optim": worker["optim"],
        "loop_optim": optimizer_settings(StudyLoop(cfg, model, tokenizer).optimizer),
    }


def main(model_dir: str, out: str) -> None:
    """Every arm at the loop's weight decay (0), then SAT-GSPO at the product's default (0.01)."""
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(model_dir)
    batch = draw_batch(model, tokenizer)
    old_model = perturbed(model)
    result: dict = {"batch": {"rows": len(batch.scores), "tokens": int(batch.response_mask.sum())}}
    for name in ARMS:
        result[name] = compare(name, model_dir, model, tokenizer, batch, old_model, weight_decay=0.0)
    result["sat_gspo_product_weight_decay"] = compare(
        "sat_gspo", model_dir, model, tokenizer, batch, old_model, weight_decay=None
    )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def load_model_dir(model_dir: str):
    """(model, tokenizer) from a model directory, as the loop's ``load_assets`` loads ``<assets>/model``."""
    from transformers import AutoTokenizer

    from verl_sat.rollout.engine import load_model

    return load_model(model_dir), AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
