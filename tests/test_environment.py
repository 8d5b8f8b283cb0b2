"""environment.yml and pyproject.toml name the same dependencies with the same constraints."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0].strip().lower()


def test_environment_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted.extend(extra)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda = {_name(r): r for r in pip if not r.startswith("-")}
    for requirement in wanted:
        name = _name(requirement)
        assert name in conda, f"environment.yml lacks {requirement}"
        if name == "torch":
            assert conda[name] == "torch==2.13.0", "environment.yml must pin the CPU torch the Makefile installs"
        else:
            assert conda[name].replace(" ", "") == requirement.replace(" ", ""), f"{conda[name]} != {requirement}"
    extra = set(conda) - {_name(r) for r in wanted}
    assert not extra, f"environment.yml has packages pyproject.toml lacks: {sorted(extra)}"


def test_makefile_pins_the_same_torch():
    assert "TORCH_PIN ?= torch==2.13.0" in (ROOT / "Makefile").read_text()
