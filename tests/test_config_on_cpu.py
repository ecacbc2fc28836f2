"""SATPolicyLossConfig: validation errors name the key and value; Hydra/_target_ selection works."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.actor import PolicyLossConfig

from verl_sat import SATPolicyLossConfig
from verl_sat.sat.config import sat_settings


@pytest.mark.parametrize(
    "field,value",
    [
        ("sat_alpha", 0.0),
        ("sat_alpha", 1.0),
        ("sat_alpha", 1.5),
        ("sat_alpha", -0.1),
        ("sat_alpha", "0.9"),
        ("sat_alpha", True),
        ("sat_kernel", "gauss"),
        ("sat_kernel", ""),
        ("sat_kernel_exponent", 0.0),
        ("sat_kernel_exponent", -2.0),
        ("sat_kernel_exponent", "2"),
        ("sat_enabled", "yes"),
    ],
)
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SATPolicyLossConfig(**{field: value})
    assert f"actor_rollout_ref.actor.policy_loss.{field}" in str(err.value)
    assert repr(value) in str(err.value)


def test_defaults_are_the_papers():
    cfg = SATPolicyLossConfig()
    assert (cfg.sat_enabled, cfg.sat_alpha, cfg.sat_kernel, cfg.sat_kernel_exponent) == (True, 0.9, "hill", 2.0)
    assert isinstance(cfg, PolicyLossConfig)


def test_selected_through_target_like_hydra():
    node = OmegaConf.create(
        {
            "_target_": "verl_sat.SATPolicyLossConfig",
            "loss_mode": "sat_gspo",
            "sat_alpha": 0.8,
            "sat_kernel_exponent": 3,
        }
    )
    cfg = omega_conf_to_dataclass(node)
    assert isinstance(cfg, SATPolicyLossConfig)
    assert (cfg.loss_mode, cfg.sat_alpha, cfg.sat_kernel_exponent) == ("sat_gspo", 0.8, 3)
    # hydra wraps the ValueError; the message still names the key and the value
    with pytest.raises(Exception, match=r"policy_loss\.sat_alpha must be a number in \(0, 1\), got 2"):
        omega_conf_to_dataclass(OmegaConf.create({"_target_": "verl_sat.SATPolicyLossConfig", "sat_alpha": 2}))


def test_sat_settings_from_plain_verl_config_and_dicts():
    assert sat_settings(PolicyLossConfig(loss_mode="sat")) == SATPolicyLossConfig()
    from_dict = sat_settings(OmegaConf.create({"loss_mode": "sat", "sat_alpha": 0.75}))
    assert from_dict.sat_alpha == 0.75
    with pytest.raises(ValueError, match="sat_kernel"):
        sat_settings({"sat_kernel": "box"})


def test_the_policy_loss_defaults_node_is_the_dataclass():
    """``sat_policy_loss_defaults`` (composed into the SAT algorithm options) is registered from the
    dataclass, so a changed default reaches every composed config with nothing retyped."""
    import dataclasses

    from hydra.core.config_store import ConfigStore

    from verl_sat.sat.config import POLICY_LOSS_DEFAULTS_NODE, SAT_FIELDS

    node = ConfigStore.instance().load(f"{POLICY_LOSS_DEFAULTS_NODE}.yaml").node
    defaults = SATPolicyLossConfig()
    assert set(SAT_FIELDS) == {f.name for f in dataclasses.fields(SATPolicyLossConfig)} - {
        f.name for f in dataclasses.fields(PolicyLossConfig)
    }
    assert OmegaConf.to_container(node) == {name: getattr(defaults, name) for name in SAT_FIELDS}


def test_the_sat_node_is_read_in_one_pass_naming_a_bad_key_under_its_prefix():
    from verl_sat.config_node import config_from_node
    from verl_sat.trainer.recipe import SATRecipeConfig

    node = OmegaConf.create({"lag": 8, "sentinel": {"enabled": True, "window": 30}, "heldout": {"at": [4, 2]}})
    sat = config_from_node(SATRecipeConfig, node, "sat")
    assert (sat.lag, sat.sentinel.enabled, sat.sentinel.window, sat.heldout.at) == (8, True, 30, [2, 4])
    assert sat.faults == type(sat.faults)() and sat.auto_lag == type(sat.auto_lag)()  # absent: the defaults
    for section in ("sentinel", "faults", "auto_lag", "heldout"):
        with pytest.raises(ValueError, match=rf"unknown key\(s\) under sat\.{section}: sat\.{section}\.foo; known: "):
            SATRecipeConfig.from_node({section: {"foo": 1}})
        with pytest.raises(ValueError, match=rf"sat\.{section} must be a mapping of keys, got 3"):
            SATRecipeConfig.from_node({section: 3})
    with pytest.raises(ValueError, match=r"unknown key\(s\) under sat: sat\.bar, sat\.foo; known: "):
        SATRecipeConfig.from_node({"foo": 1, "bar": 2})
    with pytest.raises(ValueError, match=r"sat\.sentinel\.window must be an integer >= 2, got 'x'"):
        SATRecipeConfig.from_node({"sentinel": {"window": "x"}})


def test_every_checked_field_refuses_a_wrong_value_naming_its_dotted_key():
    """Each field declared with config_node.checked (flag, one_of, integer, number, text) is checked
    when its section is built: a value no check accepts (an object) is refused, naming the key and the
    value; the declared default passes its own check."""
    import dataclasses

    from verl_sat.default.heldout import HeldoutConfig
    from verl_sat.trainer.auto_lag import AutoLagConfig
    from verl_sat.trainer.recipe import SATRecipeConfig
    from verl_sat.trainer.sentinel import SentinelConfig

    sections = {
        "sat": SATRecipeConfig,
        "sat.sentinel": SentinelConfig,
        "sat.auto_lag": AutoLagConfig,
        "sat.heldout": HeldoutConfig,
        "actor_rollout_ref.actor.policy_loss": SATPolicyLossConfig,
    }
    checked = 0
    for prefix, cls in sections.items():
        for field in dataclasses.fields(cls):
            if "ok" not in field.metadata:
                continue
            assert field.metadata["ok"](field.default), f"{prefix}.{field.name}'s default fails its own check"
            with pytest.raises(ValueError, match=rf"^{prefix}\.{field.name} must be .*, got <object object"):
                cls(**{field.name: object()})
            checked += 1
    assert checked >= 35  # every section declares its values' checks
