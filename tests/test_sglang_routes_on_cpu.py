"""R3 on SGLang: verl's own ``SGLangHttpServer.generate`` decodes SGLang 0.5.12's routed experts.

verl_sat.verl_fixes.sglang_routed_experts_base64_0_9_1_sglang_0_5_12. Each check runs verl 0.9.1's
real ``generate`` (async_sglang_server.py) in a fresh interpreter without ``VERL_PLATFORM`` (the
fix is for every platform), with SGLang's modules registered as import scaffolding
(tests/sglang_stub.py). The tokenizer manager's output is built the way SGLang 0.5.12 builds it:
the capturer's int32 ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]`` rows
(state_capturer/base.py ``get_topk``), base64-encoded with ``pybase64.b64encode(val.numpy()
.tobytes()).decode("utf-8")`` (managers/tokenizer_manager.py, skip_tokenizer_init; the
detokenizer's ``_b64_encode_per_request`` is the same expression). The model config is
Qwen3-30B-A3B-Base's (48 layers, top-8 of 128 experts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pybase64
import pytest
import torch

import verl_sat
from verl_sat.verl_fixes import decode_routed_experts

pytestmark = pytest.mark.gpu_branch

TESTS = Path(__file__).resolve().parent
CLEARED = ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")

CHECK = r"""
import asyncio, json, os, sys
from types import SimpleNamespace
assert "VERL_PLATFORM" not in os.environ
import sglang_stub
sglang_stub.install()
import numpy as np, pybase64, torch
from transformers import Qwen3MoeConfig
import verl.workers.rollout.sglang_rollout.async_sglang_server as server_module

skip_tokenizer_init, unfixed = sys.argv[1] == "1", sys.argv[2] == "1"
# Qwen3-30B-A3B-Base's config.json: 48 layers, top-8 of 128 experts.
hf_config = Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8)
prompt_ids, output_ids = list(range(11)), list(range(100, 105))
seqlen = len(prompt_ids) + len(output_ids)
generator = torch.Generator().manual_seed(0)
routes = torch.randint(0, 128, (seqlen - 1, 48, 8), generator=generator, dtype=torch.int32)
# SGLang 0.5.12, managers/tokenizer_manager.py (and detokenizer_manager._b64_encode_per_request):
wire = pybase64.b64encode(routes.numpy().tobytes()).decode("utf-8")
requests = []

class TokenizerManager:
    async def generate_request(self, obj, request=None):
        requests.append(obj.__dict__)
        yield {"output_ids": output_ids, "meta_info": {"finish_reason": {"type": "stop"}, "routed_experts": wire}}

server = object.__new__(server_module.SGLangHttpServer)
server.config = SimpleNamespace(
    max_model_len=4096, prompt_length=2048, response_length=2048, enable_rollout_routing_replay=True,
    skip_tokenizer_init=skip_tokenizer_init, mtp=None,
)
server.model_config = SimpleNamespace(hf_config=hf_config, lora_rank=0, lora={})  # no LoRA
server.tokenizer_manager = TokenizerManager()
server._disaggregation_role, server._pd_decode_peers = None, []
server.global_steps, server.replica_rank = 3, 0
generate = server_module.SGLangHttpServer.generate
if unfixed:
    generate = generate.__wrapped__
try:
    out = asyncio.run(generate(server, prompt_ids, {"max_new_tokens": 5}, "r0"))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)[:300]}))
    raise SystemExit(0)
got = np.asarray(out.routed_experts)
print(json.dumps({
    "asked_for_routes": bool(requests[0].get("return_routed_experts")),
    "shape": list(got.shape), "dtype": str(got.dtype), "equal": bool((got == routes.numpy()).all()),
    "token_ids": list(out.token_ids),
}))
"""


def run_generate(cwd: Path, skip_tokenizer_init: bool, unfixed: bool = False) -> dict:
    """verl's ``generate`` on SGLang 0.5.12's wire format, in a fresh interpreter; its JSON line."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    source = str(Path(verl_sat.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([source, str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, "-c", CHECK, "1" if skip_tokenizer_init else "0", "1" if unfixed else "0"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("skip_tokenizer_init", [True, False], ids=["skip_tokenizer_init", "tokenizer_in_server"])
def test_verl_generate_decodes_sglang_0_5_12_routes(tmp_path: Path, skip_tokenizer_init: bool) -> None:
    result = run_generate(tmp_path, skip_tokenizer_init)
    assert "error" not in result, result
    assert result["asked_for_routes"]
    assert result["shape"] == [11 + 5 - 1, 48, 8]
    assert result["dtype"] == "int32"
    assert result["equal"]
    assert result["token_ids"] == list(range(100, 105))


@pytest.mark.parametrize(
    ("skip_tokenizer_init", "error"),
    [(True, "AttributeError"), (False, "ModuleNotFoundError")],
    ids=["skip_tokenizer_init", "tokenizer_in_server"],
)
def test_verl_generate_fails_on_sglang_0_5_12_routes_without_the_fix(
    tmp_path: Path, skip_tokenizer_init: bool, error: str
) -> None:
    """The bug the fix is for: verl 0.9.1's own generate raises on both paths."""
    result = run_generate(tmp_path, skip_tokenizer_init, unfixed=True)
    assert result.get("error") == error, result


def wire(routes: torch.Tensor) -> str:
    """SGLang 0.5.12's encoding of one request's routes (managers/tokenizer_manager.py)."""
    return pybase64.b64encode(routes.numpy().tobytes()).decode("utf-8")


def test_decode_is_the_inverse_of_sglangs_encoding() -> None:
    routes = torch.randint(0, 128, (7, 48, 8), dtype=torch.int32)
    decoded = decode_routed_experts(wire(routes), 48, 8)
    assert decoded.dtype == torch.int32 and tuple(decoded.shape) == (7, 48, 8)
    assert torch.equal(decoded, routes)
    # Rows are tokens: token t's layer l experts come back in place (C order).
    assert decoded[3, 17].tolist() == routes[3, 17].tolist()
    assert decode_routed_experts(None, 48, 8) is None
    assert torch.equal(decode_routed_experts(routes.numpy(), 48, 8), routes)


def test_decode_names_a_model_mismatch() -> None:
    routes = torch.zeros((5, 48, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"num_hidden_layers 47 x num_experts_per_tok 8"):
        decode_routed_experts(wire(routes), 47, 8)
