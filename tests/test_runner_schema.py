"""The run configuration's schema (kvcert.defaults.RunConfig) is the one description of the knobs: the YAML
holds none, the composed config is the schema's, a cell's identity and the calibration's knobs are read from
it, and a wrongly typed value still ends in the validation's one line."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf

from kvcert import defaults
from kvcert.calibration import KNOBS, design_knobs
from kvcert.errors import ConfigError
from kvcert.hydra_app import CONF_DIR, compose
from kvcert.runner.config import validate


def test_the_yaml_configs_are_defaults_lists_only():
    for name in ("run", "calibrate"):
        assert set(yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())) == {"defaults"}, name


def test_the_composed_config_is_the_schema_with_its_groups():
    cfg = compose(["out_dir=x"])
    assert OmegaConf.get_type(cfg) is defaults.RunConfig
    plain = OmegaConf.to_container(cfg, resolve=True)
    schema = dataclasses.asdict(defaults.RunConfig(out_dir="x"))
    for key in defaults.KEYS:
        if key not in ("data", "model"):
            assert plain[key] == schema[key], key
    assert list(plain) == list(defaults.KEYS)  # a cell's config.yaml lists the keys in the schema's order
    assert plain["data"]["name"] == "ruler" and plain["model"]["kind"] == "smollm2"  # RunConfig.defaults


def test_a_cell_is_identified_by_the_knobs_that_change_what_it_computes():
    # the 22 keys a cell's checkpoints were identified by before the schema existed (runner/cell.py)
    before = {"data", "model", "policies", "designs", "budgets", "seeds", "extra_grids", "setting", "n_items", "shard",
              "n_shards", "oracle", "certify", "delta", "observation_window", "design_options", "max_context_tokens",
              "truncate", "store_steps", "policy_options", "calibration", "shard_by"}
    assert set(defaults.IDENTITY_KEYS) == before
    # keys that identify a cell only when set (a target): cells without them keep the identity above
    assert set(defaults.WHEN_SET_KEYS) == {"target_error", "target_delta"}
    assert set(defaults.KEYS) - set(defaults.IDENTITY_KEYS) == {"out_dir", "progress", "threads",
                                                               "check_calibration_prompts", *defaults.WHEN_SET_KEYS}


def test_the_calibration_is_bound_to_the_schema_design_knobs():
    assert KNOBS == defaults.DESIGN_KNOBS
    knobs = design_knobs()
    assert list(knobs) == list(KNOBS)
    assert knobs["n_sink"] == defaults.DESIGN.n_sink and knobs["delta"] == defaults.RUN.delta


@pytest.mark.parametrize("override, message", [
    ("n_items=abc", "n_items='abc': expected int"),
    ("seeds=[1.5]", "seeds: 1.5 is not an integer"),
    ("design_options.n_recent=0", "design_options.n_recent=0: must be >= 1"),
    ("extra_grids=[{policies:[uniform],designs:[poisson],budgets:[2]}]", "extra_grids[0].budgets: 2.0 is outside (0, 1]"),
])
def test_a_bad_value_fails_validation_with_its_key_and_value(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose([override, "out_dir=x"]))
    assert str(err.value) == message


def test_a_committed_config_without_the_later_keys_takes_their_defaults():
    cfg = OmegaConf.to_container(compose(["out_dir=x"]), resolve=True)
    for key in ("shard_by", "check_calibration_prompts", "store_steps"):
        del cfg[key]
    cell = validate(cfg)
    assert (cell.shard_by, cell.check_calibration_prompts, cell.store_steps) == ("item", True, True)
