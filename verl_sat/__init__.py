"""verl-sat: the Staleness-Adaptive Trust Region (SAT) for asynchronous RL on verl.

``import verl_sat`` registers the policy losses ``"sat"`` and ``"sat_gspo"`` in verl's
``POLICY_LOSS_REGISTRY`` (docs/sat.md#the-rule). See docs/sat.md.
"""

# A CPU run with SGLang installed: PyPI's torchvision (a CUDA build) imports only once two of its op
# schemas exist, and verl's plugin imports transformers, which imports torchvision; neither imports verl.
from verl_sat.cpu.sglang import prepare_process  # noqa: I001

prepare_process()

# Import verl first: its plugin loader imports verl_sat.plugin, which needs our submodules. Were
# verl first imported from inside one of them (half-initialized), the plugin would fail and verl
# would swallow the error.
import verl  # noqa: E402, F401, I001

from verl_sat.sat.config import SATPolicyLossConfig  # noqa: E402
from verl_sat.sat.losses import compute_policy_loss_sat, compute_policy_loss_sat_gspo  # noqa: E402

__all__ = ["SATPolicyLossConfig", "compute_policy_loss_sat", "compute_policy_loss_sat_gspo"]
__version__ = "0.1.0"
