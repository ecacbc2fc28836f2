"""The GPU install (``recipes/sat_paper/install_gpu.sh``) and its one source of versions
(``verl_sat/preflight/stack.py``, read through ``recipes/sat_paper/gpu_stack.py``): pip's own
resolver answers for the GPU node, and a pin that conflicts makes the dry run fail, naming the conflict.

The dry runs need the package index (CI reaches it). Each downloads what pip's resolver reads: only
each wheel's metadata where the index serves it (PEP 658), else whole wheels (several GB: about
7 min here, where it does not).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from verl_sat.preflight import stack
from verl_sat.preflight.stack import GPU_STACK, OVERRIDES, override_for

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "sat_paper" / "install_gpu.sh"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_stack  # noqa: E402  (the script install_gpu.sh runs)


def _dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    """``install_gpu.sh --dry-run`` with ``args``, its output and exit status."""
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args], cwd=REPO, capture_output=True, text=True, timeout=1500
    )


def _verl_extra_pins(extra: str) -> dict[str, str]:
    """``name -> version`` of each ``==`` pin of an extra in the installed verl's metadata."""
    pins: dict[str, str] = {}
    for line in importlib.metadata.requires("verl") or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}):
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned:
                pins[stack.canonical_name(req.name)] = pinned[0]
    return pins


def test_the_stack_pins_what_verls_sglang_and_cupy_extras_pin() -> None:
    """torch, transformers, SGLang and cupy as verl 0.9.1's own metadata pins them."""
    assert importlib.metadata.version("verl") == GPU_STACK["verl"]
    expected = {**_verl_extra_pins("sglang"), **_verl_extra_pins("cupy-cu130")}
    assert {"sglang", "transformers", "torch", "cupy-cuda13x"} <= set(expected)
    assert {name: GPU_STACK.get(name) for name in expected} == expected


@pytest.mark.parametrize(
    ("dependent", "requirement"),
    [
        ("SGLang", "Transformers == 5.6.0"),
        ("megatron_bridge", "transformers>=5.8.1,<5.9.0"),
        ("Megatron.Core", 'nvidia_resiliency_ext==0.6.0 ; extra=="dev"'),
    ],
)
def test_override_for_normalises_names_specifiers_and_markers(dependent: str, requirement: str) -> None:
    """A requirement spelled as a package's metadata spells it finds its override."""
    found = override_for(dependent, requirement)
    assert found is not None and found in OVERRIDES and found.reason


@pytest.mark.parametrize(
    ("dependent", "requirement"),
    [
        ("sglang", "transformers==5.9.0"),  # another version
        ("verl", "transformers==5.6.0"),  # another dependent
        ("megatron-core", "nvidia-resiliency-ext==0.6.0"),  # without the extra's marker
    ],
)
def test_an_unnamed_requirement_has_no_override(dependent: str, requirement: str) -> None:
    """Only the named requirement of the named dependent is overridden."""
    assert override_for(dependent, requirement) is None


def test_an_override_needs_a_package_of_the_stack_and_a_reason() -> None:
    """Each override's dependent is a package of the stack, and it gives its reason."""
    assert [o for o in OVERRIDES if stack.canonical_name(o.dependent) not in GPU_STACK or not o.reason.strip()] == []


def _report(name: str, version: str, requires: list[str]) -> dict:
    """A pip ``--report`` holding one package (the fields gpu_stack.py reads)."""
    return {"install": [{"metadata": {"name": name, "version": version, "requires_dist": requires}}]}


def test_kept_requirements_drop_the_overrides_and_check_no_deps_pins() -> None:
    """Overridden and off-platform requirements go; one on another --no-deps package is checked."""
    requires = [
        "transformers<5.9.0,>=5.8.1",
        "flashinfer-python==0.6.8.post1",
        "megatron-core[dev,mlm]",
        'mamba-ssm; extra == "ssm"',
        'decord2; platform_machine == "aarch64"',
        "torch>=2.6.0",
    ]
    assert gpu_stack.kept_requirements(_report("megatron-bridge", GPU_STACK["megatron-bridge"], requires)) == [
        "torch>=2.6.0"
    ]
    with pytest.raises(ValueError, match=r"megatron-core>=0\.19.*megatron-core\[dev,mlm\]==0\.18\.0"):
        gpu_stack.kept_requirements(_report("megatron-bridge", GPU_STACK["megatron-bridge"], ["megatron-core>=0.19"]))
    with pytest.raises(ValueError, match=r"sglang 0\.5\.11, the stack pins 0\.5\.12"):
        gpu_stack.kept_requirements(_report("sglang", "0.5.11", []))


def test_an_override_the_package_no_longer_declares_is_reported() -> None:
    """A stale override (the dependent dropped the pin) is named, so OVERRIDES stays true."""
    stale = gpu_stack.stale_overrides(_report("sglang", GPU_STACK["sglang"], ["transformers==5.9.0"]))
    assert gpu_stack.Override("sglang", "transformers==5.6.0", OVERRIDES[0].reason) in stale


# What install_gpu.sh asks gpu_stack.py before it installs packaging (a fresh Python on the GPU node).
BEFORE_PACKAGING = ("--no-deps", "--pip", "--python-version", "--platforms", "--pure-sdists")


@pytest.mark.parametrize("question", BEFORE_PACKAGING)
def test_what_the_install_asks_first_runs_on_a_python_without_packaging(question: str) -> None:
    """-S -I: no site-packages, so no packaging; the answer equals the one this environment gives."""
    script = str(SCRIPT.parent / "gpu_stack.py")
    bare = subprocess.run([sys.executable, "-S", "-I", script, question], capture_output=True, text=True, timeout=60)
    here = subprocess.run([sys.executable, script, question], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 0, bare.stderr[-2000:]
    assert bare.stdout == here.stdout and bare.stdout.strip()
    probe = subprocess.run([sys.executable, "-S", "-I", "-c", "import packaging"], capture_output=True, timeout=60)
    assert probe.returncode != 0  # the bare interpreter really lacks it


@pytest.mark.extended  # ~3-7 min: pip downloads whole wheels here (tests/README.md)
def test_the_dry_run_resolves_the_stack_for_the_gpu_node() -> None:
    """pip's resolver, for Python 3.12 on manylinux x86_64, finds one solution with the stack's pins."""
    done = _dry_run()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert re.search(r"^Would install .*\bray-2\.60\.0\b", done.stdout, flags=re.M), done.stdout[-2000:]
    assert "torch-2.11.0 " in done.stdout and "transformers-5.9.0 " in done.stdout
    for name in ("sglang", "ray", "megatron-core", "transformers", "torch", "verl"):
        assert re.search(rf"^  {name}=={re.escape(GPU_STACK[name])}\b", done.stdout, flags=re.M), name
    assert "the stack resolves; nothing was installed" in done.stdout


@pytest.mark.e2e
def test_a_conflicting_pin_makes_the_dry_run_fail_naming_it() -> None:
    """SGLang's own transformers pin, added without its override, has no solution."""
    done = _dry_run("--extra", "transformers==5.6.0")
    assert done.returncode != 0
    assert "ResolutionImpossible" in done.stderr
    assert re.search(r"transformers==5\.6\.0.*transformers==5\.9\.0", done.stderr, flags=re.S), done.stderr[-3000:]
    assert "pip found no solution for the stack" in done.stderr
