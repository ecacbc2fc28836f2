"""Preflight: check a cell of the paper's grid against the node it is about to run on (docs/reproduce.md).

``python -m verl_sat.preflight <method> <lag> [--run-dir DIR] [--json] [hydra overrides...]``
(Hydra's own flags such as ``--cfg job`` among the overrides are left to Hydra)
resolves the cell exactly as ``recipes/sat_paper/run.sh`` launches it (``verl_sat.paper.grid``
composes it, then ``verl_sat.trainer.recipe`` maps ``sat.lag`` / ``sat.routing_replay`` onto verl's keys
as ``verl_sat.main`` does), gathers the node's facts once (``probe``) and runs pure checks
``(config, facts) -> findings`` over them. Every failure is one line naming the key or package
and the fix; the exit code is 1 when any check fails. ``run.sh`` runs it before the launch
(``SAT_SKIP_PREFLIGHT=1`` skips it).

What is checked, and the estimates used, is listed in docs/reproduce.md. Nothing heavy is
imported at module import: torch, sglang, megatron, cupy, pyarrow and verl's checkpoint engines
are imported inside ``probe`` only, so the checks run on any machine with faked ``Facts``.

Modules: ``facts`` (``Facts``, ``GPU``, ``ModelFacts``, ``Finding``; config helpers and estimates
such as ``param_count``, ``host_optimizer_bytes``, ``checkpoint_bytes``), ``checks`` (the pure
``check_*`` functions, ``CHECKS``, ``run_checks``), ``probe`` (``probe_*`` and ``probe``, the only
code that inspects the node) and ``cli`` (``resolve_cell``, argument parsing, output, exit code;
``__main__`` runs it).
"""

from verl_sat.preflight.checks import (
    CHECKS,
    check_checkpoint_engine,
    check_context_length,
    check_data,
    check_disk,
    check_end_of_turn,
    check_gpu_count,
    check_gpu_memory,
    check_host_memory,
    check_megatron,
    check_parallel_layout,
    check_r3_padding,
    check_reward_function,
    check_routing_replay,
    check_versions,
    run_checks,
)
from verl_sat.preflight.cli import (
    main,
    resolve_cell,
    split_hydra_flags,
)
from verl_sat.preflight.facts import (
    BRIDGES,
    GPU,
    MEGATRON_BRIDGE_FOR_VERL,
    PROBED_MODULES,
    ROUTED_EXPERTS_ARG,
    SGLANG_FOR_VERL,
    VERL_VERSION,
    Facts,
    Finding,
    ModelFacts,
    as_list,
    bridge_module,
    buffered_prompts,
    checkpoint_bytes,
    host_optimizer_bytes,
    kept_checkpoints,
    param_count,
    rollout_buffer_bytes,
)
from verl_sat.preflight.probe import (
    probe,
    probe_data,
    probe_megatron_pins,
    probe_model,
    probe_reward,
    probe_versions,
    unmet_requirements,
)

__all__ = [
    "BRIDGES",
    "CHECKS",
    "Facts",
    "Finding",
    "GPU",
    "MEGATRON_BRIDGE_FOR_VERL",
    "ModelFacts",
    "PROBED_MODULES",
    "ROUTED_EXPERTS_ARG",
    "SGLANG_FOR_VERL",
    "VERL_VERSION",
    "as_list",
    "bridge_module",
    "buffered_prompts",
    "check_checkpoint_engine",
    "check_context_length",
    "check_data",
    "check_disk",
    "check_end_of_turn",
    "check_gpu_count",
    "check_gpu_memory",
    "check_host_memory",
    "check_megatron",
    "check_parallel_layout",
    "check_r3_padding",
    "check_reward_function",
    "check_routing_replay",
    "check_versions",
    "checkpoint_bytes",
    "host_optimizer_bytes",
    "kept_checkpoints",
    "main",
    "param_count",
    "probe",
    "probe_data",
    "probe_megatron_pins",
    "probe_model",
    "probe_reward",
    "probe_versions",
    "resolve_cell",
    "rollout_buffer_bytes",
    "run_checks",
    "split_hydra_flags",
    "unmet_requirements",
]
