"""CPU support for verl 0.9.1: a platform plugin and a CPU weight-sync checkpoint engine.

Selected with ``VERL_PLATFORM=cpu``. :func:`register` is called by ``verl_sat.plugin`` in every
process that imports verl (Ray workers included); it is cheap and never imports torch-heavy verl
modules eagerly. See ``docs/cpu.md`` for the env vars and Hydra overrides of a full run.

What the patch modules (``megatron``, ``sglang``, ``vllm``) share is ``verl_sat.cpu.patching``.
"""

from verl_sat.cpu import platform


def register() -> None:
    """:func:`verl_sat.cpu.platform.register`; with ``VERL_PLATFORM=cpu``, also the Megatron patches
    (``verl_sat.cpu.megatron``: post-import hooks, nothing is imported unless verl's Megatron engine is used)
    and, where SGLang is installed, SGLang's (``verl_sat.cpu.sglang``)."""
    platform.register()
    if platform.is_selected():
        from verl_sat.cpu import megatron, sglang

        megatron.install()
        sglang.install()
