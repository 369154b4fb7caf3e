"""The set-up promises: exact pins, conda and pip agree, the two commands exist, CI runs exactly `make test`."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", req.strip())
        assert m, f"not an exact pin: {req!r} (every dependency is pinned with ==)"
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return _pins(project["dependencies"] + project["optional-dependencies"]["test"])


def _conda_pins() -> tuple[str, dict[str, str]]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return python, _pins([p for p in pip if not p.startswith("-")])  # -e ., --extra-index-url


def test_torch_is_pinned_to_the_cpu_wheel_version():
    assert _pyproject_pins()["torch"] == "2.13.0"


def test_environment_yml_has_the_same_pins_as_pyproject():
    python, conda = _conda_pins()
    assert python == "python=3.11"
    assert conda == _pyproject_pins()


def test_the_installed_versions_are_the_pinned_ones():
    from importlib.metadata import version

    for name, pin in _pyproject_pins().items():
        assert version(name).split("+")[0] == pin, f"{name}: installed {version(name)}, pinned {pin}"


def test_ci_runs_exactly_make_test():
    lines = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[-1] == "exec make test"


def test_readme_gives_the_two_commands_first():
    readme = (REPO / "README.md").read_text()
    first_code = readme[readme.index("```"):]
    assert "make lab" in first_code[:400] and "make test" in first_code[:400]


def test_lab_binds_localhost_with_token_auth():
    lab = (REPO / "Makefile").read_text().split("\nlab:")[1].split("\n\n")[0]
    assert "--ServerApp.ip=127.0.0.1" in lab
    assert "0.0.0.0" not in lab and "token=''" not in lab and 'token=""' not in lab
