"""Import scaffolding for verl's SGLang server module on a machine without SGLang.

verl 0.9.1's ``workers/rollout/sglang_rollout/async_sglang_server.py`` imports SGLang at module
level, and SGLang 0.5.12 cannot be installed next to a CPU torch (it pins a CUDA build). The tests
that execute verl's own server code therefore register these modules first: each is an empty
module that answers every attribute with a plain class (a ``GenerateReqInput`` stub keeps its
keyword arguments). Nothing of SGLang's behaviour is faked here: the wire format the tests feed
verl is built exactly as SGLang 0.5.12 builds it (each test cites the line), and the modules SGLang
0.5.12 no longer has (``sglang.srt.layers.moe.routed_experts_capturer``) are not registered.

Use in a fresh interpreter (``install()`` before ``import verl``...): the stubs are process-wide.
"""

from __future__ import annotations

import sys
from types import ModuleType

SGLANG_VERSION = "0.5.12"
# Every sglang module verl's async_sglang_server (and what it imports) imports at module level.
MODULES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.entrypoints",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.EngineBase",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.server_args",
    "sglang.srt.utils",
    "sglang.srt.weight_sync",
    "sglang.srt.weight_sync.utils",
)


class _Stub:
    """Any SGLang class or function verl names: keeps its keyword arguments."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.__dict__.update(kwargs)


class _StubModule(ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = type(name, (_Stub,), {})
        setattr(self, name, stub)
        return stub


def install() -> None:
    """Register the stub modules (idempotent)."""
    for name in MODULES:
        if name not in sys.modules:
            module = _StubModule(name)
            module.__path__ = []  # a package, so that submodules resolve through sys.modules
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)
    sys.modules["sglang"].__version__ = SGLANG_VERSION
