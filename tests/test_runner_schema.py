"""The run configuration's schema (kvcert.run_schema.RunConfig) is the one description of the knobs: the YAML
holds none, the composed config is the schema's, a cell's identity and the calibration's knobs are read from
it, and a wrongly typed value still ends in the validation's one line."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf

from kvcert import run_schema
from kvcert.calibration import KNOBS, design_knobs
from kvcert.errors import ConfigError
from kvcert.hydra_app import CONF_DIR, compose
from kvcert.runner.config import validate


def test_the_yaml_configs_are_defaults_lists_only():
    for name in ("run", "calibrate"):
        assert set(yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())) == {"defaults"}, name


def test_the_composed_config_is_the_schema_with_its_groups():
    cfg = compose(["out_dir=x"])
    assert OmegaConf.get_type(cfg) is run_schema.RunConfig
    plain = OmegaConf.to_container(cfg, resolve=True)
    schema = dataclasses.asdict(run_schema.RunConfig(out_dir="x"))
    for key in run_schema.KEYS:
        if key not in ("data", "model"):
            assert plain[key] == schema[key], key
    assert list(plain) == list(run_schema.KEYS)  # a cell's config.yaml lists the keys in the schema's order
    assert plain["data"]["name"] == "ruler" and plain["model"]["kind"] == "smollm2"  # RunConfig.defaults


def test_a_cell_is_identified_by_the_knobs_that_change_what_it_computes():
    # the 22 keys a cell's checkpoints were identified by before the schema existed (runner/cell.py)
    before = {"data", "model", "policies", "designs", "budgets", "seeds", "extra_grids", "setting", "n_items", "shard",
              "n_shards", "oracle", "certify", "delta", "observation_window", "design_options", "max_context_tokens",
              "truncate", "store_steps", "policy_options", "calibration", "shard_by"}
    # and the keys added since, which a cell's config.yaml and identity leave out at their default (an allocator,
    # a target): cells without them keep the identity above
    assert set(run_schema.ELIDED_AT_DEFAULT) == {"allocator", "allocator_options", "target_error", "target_delta",
                                                 "target_floor", "decisions", "chat_template"}
    assert set(run_schema.IDENTITY_KEYS) == before | set(run_schema.ELIDED_AT_DEFAULT)
    assert set(run_schema.KEYS) - set(run_schema.IDENTITY_KEYS) == {"out_dir", "progress", "threads",
                                                               "check_calibration_prompts"}


def test_the_calibration_is_bound_to_the_schema_design_knobs():
    assert KNOBS == run_schema.DESIGN_KNOBS
    knobs = design_knobs()
    # the certificate's defenses, added after committed files, are recorded only away from their default (0)
    assert list(knobs) == [k for k in KNOBS if k not in run_schema.DESIGN_ELIDED_AT_DEFAULT]
    assert list(design_knobs(run_schema.DesignOptions(tail_mix=0.2, head_attention_share=0.5))) == list(KNOBS)
    assert knobs["n_sink"] == run_schema.DESIGN.n_sink and knobs["delta"] == run_schema.RUN.delta


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


def test_a_uniform_cell_writes_its_committed_config_byte_for_byte():
    """The allocator keys at their default leave a cell's config.yaml (hashed by its manifest) as committed."""
    from pathlib import Path

    from kvcert.runner.cell import config_yaml

    committed = sorted((Path(__file__).resolve().parents[1] / "results" / "v4" / "cells").glob("*/shard-0/config.yaml"))
    assert committed
    for path in committed[:3]:
        plain = yaml.safe_load(path.read_text())
        assert not set(plain) & set(run_schema.ELIDED_AT_DEFAULT)
        position = list(run_schema.KEYS).index("allocator")  # where the composed config now holds the new keys
        items = list(plain.items())
        with_keys = dict(items[:position] + [("allocator", "uniform"), ("allocator_options", None)] + items[position:])
        assert config_yaml(with_keys) == path.read_text(), path
        assert "allocator" in config_yaml({**with_keys, "allocator": "adakv"})
        assert validate({**plain, "out_dir": "x"}).allocator == "uniform"


@pytest.mark.parametrize("override, message", [
    ("allocator=ada", "allocator='ada' is unknown; known: ['uniform', 'adakv', 'pyramidkv']"),
    ("+allocator_options={beta: 20}", "allocator_options.beta: not an option of allocator=uniform; known: none"),
    ("allocator=adakv", None),
])
def test_the_allocator_and_its_options_are_checked(override, message):
    overrides = [override, "out_dir=x"]
    if message is None:
        cell = validate(compose([*overrides, "+allocator_options={alpha_safeguard: 0.5}"]))
        assert (cell.allocator, cell.allocator_options) == ("adakv", {"alpha_safeguard": 0.5})
        with pytest.raises(ConfigError, match="alpha_safeguard=2"):
            validate(compose([*overrides, "+allocator_options={alpha_safeguard: 2}"]))
        return
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert str(err.value) == message
