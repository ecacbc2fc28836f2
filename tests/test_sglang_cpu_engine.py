"""SGLang 0.5.12's real engine on this CPU (``bash recipes/cpu/install_sglang_cpu.sh``), with
verl_sat.cpu.sglang's patches: what each work-around is for, shown on the real library call, and the
engine's routes against Hugging Face's router.

``extended`` (tests/README.md): SGLang is not part of the test extra (it is installed beside it by
the script, ~1 min), and one engine start takes 35-130 s on 2 cores. Without SGLang they skip,
naming the script. The trainer runs on SGLang are in tests/test_sglang_cpu_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_sat.cpu import sglang as cpu_sglang

pytestmark = [
    pytest.mark.extended,  # tests/README.md: left out of the default run (SGLang installed beside the test extra)
    pytest.mark.skipif(
        cpu_sglang.installed_version("sglang") != cpu_sglang.WRITTEN_FOR,
        reason=f"needs sglang=={cpu_sglang.WRITTEN_FOR}: bash recipes/cpu/install_sglang_cpu.sh",
    ),
]

CLEARED = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "SGLANG_USE_CPU_ENGINE")


def run_python(script: str, cwd: Path, platform: str | None = "cpu", timeout: float = 900) -> str:
    """``script`` (a file, so that SGLang's spawned children can import its main module) in a fresh
    interpreter, with or without the CPU platform; its stdout; a failure shows its stderr."""
    path = cwd / "script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED} | {"OMP_NUM_THREADS": "1"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, str(path)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


WITHOUT_PATCHES = """
import importlib, traceback

def error(module):
    try:
        importlib.import_module(module)
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "imported"

print(error("torchvision"))                             # what SGLang's utilities import first
from verl_sat.cpu import sglang as cpu_sglang            # importing verl_sat registers them on a CPU torch
print(bool(cpu_sglang._TORCHVISION_LIBRARY))
print(error("sglang.srt.utils"))
print(error("sglang.srt.mem_cache.memory_pool_host"))   # sgl_kernel.kvcacheio, no stand-in
cpu_sglang.install_kernel_stand_in()
print(error("sglang.srt.mem_cache.memory_pool_host"))
from sglang.srt.state_capturer import base
try:
    base.BaseHostCache(8, 4, 2, name="routed_experts")
    print("allocated")
except RuntimeError as exc:
    print("RuntimeError")
cpu_sglang.unpin(base)
print(tuple(base.BaseHostCache(8, 4, 2, name="routed_experts").buffer.shape))
"""


def test_each_import_work_around_is_needed_and_enough(tmp_path: Path) -> None:
    """Without ``VERL_PLATFORM`` (no patch installed) in the environment the script built: PyPI's
    torchvision (which SGLang's utilities import) does not import, then SGLang's utilities do once its
    two schemas are registered; its host
    memory pool does not import without the sgl_kernel stand-in, then does; R3's pinned host cache is
    refused by this torch, then allocated through the module's unpinned torch."""
    lines = run_python(WITHOUT_PATCHES, tmp_path, platform=None).strip().splitlines()[-8:]
    assert "torchvision::nms does not exist" in lines[0]
    assert lines[1] == "True" and lines[2] == "imported"
    assert lines[3].startswith("ModuleNotFoundError: No module named 'sgl_kernel'")
    assert lines[4] == "imported"
    assert lines[5] == "RuntimeError" and lines[6] == "(8, 4, 2)"


WEIGHT_SHARING = """
import subprocess, sys
import verl_sat  # the CPU platform's plugin: verl_sat.cpu.sglang's patches
import torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from verl_sat.cpu import sglang as cpu_sglang

monkey_patch_torch_reductions()  # what SGLang's update_weights does before it pickles
weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
READER = "import sys, verl_sat; from sglang.srt.utils import MultiprocessingSerializer as S; "
READER += "print(S.deserialize(sys.stdin.read())[0][1].sum().item())"
for strategy in ("file_descriptor", "file_system"):
    with cpu_sglang.sharing_strategy(strategy):
        data = MultiprocessingSerializer.serialize([("w", weight)], output_str=True)
    # a process outside this one's tree, as SGLang's scheduler is for verl's checkpoint-engine worker
    out = subprocess.run([sys.executable, "-c", READER], input=data, capture_output=True, text=True,
                         start_new_session=True)
    print(strategy, out.returncode, out.stdout.strip() or out.stderr.strip().splitlines()[-1])
"""


def test_a_cpu_weight_update_reaches_a_process_of_another_tree_only_through_named_files(tmp_path: Path) -> None:
    """verl's SGLang weight sync pickles each tensor with SGLang's serializer (after SGLang's reducer
    patch, which ``reduce_host_tensors_unchanged`` makes pass host tensors) and SGLang's scheduler
    unpickles it: with torch's default sharing (file descriptors handed over by multiprocessing's
    resource sharer) the reader is refused, with ``file_system`` it reads the weights."""
    lines = run_python(WEIGHT_SHARING, tmp_path).strip().splitlines()[-2:]
    assert lines[0].startswith("file_descriptor 1 ") and "AuthenticationError" in lines[0]
    assert lines[1] == "file_system 0 15.0"


ENGINE = """
import json, time
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
import verl_sat  # the CPU platform's plugin: verl_sat.cpu.sglang's patches
from verl_sat.cpu.sglang import SERVER_ARGS
from verl_sat.verl_fixes import decode_routed_experts

LAYERS, TOP_K = 4, 2


def hf_routes(model, ids):
    out = model(torch.tensor([ids]), output_router_logits=True)
    return [logits.topk(TOP_K, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]


def main():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=8, num_experts_per_tok=TOP_K, max_position_embeddings=256,
                            norm_topk_prob=True, dtype="float32", eos_token_id=63, bos_token_id=62, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained("model")
    from sglang.srt.entrypoints.engine import Engine
    start = time.time()
    engine = Engine(model_path="model", dtype="float32", skip_tokenizer_init=True, enable_return_routed_experts=True,
                    log_level="error", **SERVER_ARGS)
    started = time.time() - start
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16], [17, 18, 19, 20, 21, 22], [23, 24], [25, 26, 27]]
    greedy = engine.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 6, "temperature": 0,
                             "ignore_eos": True}, return_routed_experts=True)[0]
    sampled = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 1.0,
                              "ignore_eos": True}, return_routed_experts=True)
    scored = engine.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 2, "temperature": 0},
                             return_logprob=True, logprob_start_len=0)[0]
    engine.shutdown()
    with torch.no_grad():
        hf = model.generate(torch.tensor(prompts[:1]), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        pairs = matched = 0
        for prompt, out in zip(prompts[:1] + prompts, [greedy, *sampled]):
            routes = decode_routed_experts(out["meta_info"]["routed_experts"], LAYERS, TOP_K)
            ids = prompt + out["output_ids"]
            assert routes.shape == (len(ids) - 1, LAYERS, TOP_K), routes.shape
            theirs = hf_routes(model, ids[:-1])
            for layer in range(LAYERS):
                ours = routes[:, layer].sort(dim=-1).values
                matched += int((ours == theirs[layer]).all(dim=-1).sum())
                pairs += ours.shape[0]
    print(json.dumps({"started_s": round(started, 1), "greedy": greedy["output_ids"], "hf": hf, "pairs": pairs,
                      "matched": matched, "prompt_logprobs": len(scored["meta_info"]["input_token_logprobs"])}))


if __name__ == "__main__":
    main()
"""


def test_the_engine_generates_hfs_tokens_and_returns_hfs_routes_in_float32(tmp_path: Path) -> None:
    """One engine (fp32, R3 on, the CPU server arguments) on a random tiny Qwen3-MoE: greedy tokens are
    Hugging Face's; every (token, layer) route of a greedy and a concurrent sampled batch of 6 is HF's
    router top-k (overlap schedule off: on, routes came one decode step late); a prompt log-prob
    request (pinned index tensors in the logits processor) is answered instead of killing the scheduler."""
    result = json.loads(run_python(ENGINE, tmp_path).strip().splitlines()[-1])
    assert result["greedy"] == result["hf"]
    assert result["pairs"] > 200 and result["matched"] == result["pairs"], result
    assert result["prompt_logprobs"] == 4
    print(f"engine start {result['started_s']} s")
