"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages; the code passes ruff."""

import subprocess
import sys
from pathlib import Path

import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_environment_yml_lists_exactly_the_dependencies_of_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    conda = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {spec for spec in pip_section if spec != "-e ."}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    assert "-e ." in pip_section  # the course_lib package itself


def test_torch_is_pinned_to_the_release_the_course_is_tested_with():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]


def test_the_code_is_ruff_clean_with_the_projects_settings():
    """`ruff check` with pyproject.toml's settings, as the hook before each stop runs it."""
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                          text=True)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-1000:]
