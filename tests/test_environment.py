"""environment.yml (conda) and pyproject.toml (pip) ask for the same packages; the library passes ruff, has no
import cycle and no module longer than one sitting."""

import ast
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


# ---- the library reads in one sitting ------------------------------------------------------------------

LIBRARY = REPO / "course_lib"
MAX_MODULE_LINES = 420  # "no module over ~400 lines": one sitting per module


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_within_library(path: Path) -> set[str]:
    """The course_lib modules ``path`` imports, at module level or inside a function: a function-level import
    only postpones a cycle to run time (and hides it from a reader), so it counts as one."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import plots` names a module; `from .plots import x` names plots itself
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    modules = {_module_name(p) for p in LIBRARY.rglob("*.py")}
    return {name for name in found if name in modules}


def test_no_module_of_the_library_labs_or_benchmarks_is_longer_than_one_sitting():
    files = [p for folder in (LIBRARY, REPO / "labs", REPO / "benchmarks") for p in folder.rglob("*.py")]
    assert len(files) > 50 and any(p.parent.name == "labs" for p in files)
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_library_has_no_import_cycle():
    graph = {_module_name(p): _imports_within_library(p) for p in LIBRARY.rglob("*.py")}
    assert "course_lib.pipeline_parallel" in graph["course_lib.presentation.plots.pipeline"]  # relative imports resolved
    assert "course_lib.runtime.launch" in graph["course_lib.presentation.exercises.common"]            # ... two levels up, too
    assert "course_lib.feed_forward" in graph["course_lib.model"] and "course_lib.model" not in graph["course_lib.feed_forward"]

    def cycle_from(start, path):
        for nxt in graph.get(path[-1], ()):
            # a package importing its own submodules (re-exports) is not a cycle in the reading order
            if nxt.startswith(path[-1] + "."):
                continue
            if nxt == start:
                return path + [nxt]
            if nxt not in path and (found := cycle_from(start, path + [nxt])):
                return found
        return None

    cycles = [c for m in graph if (c := cycle_from(m, [m]))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_pipeline_executor_uses_no_threads():
    """Sends and receives are posted from the caller's thread, as NCCL requires (issue: one executor)."""
    tree = ast.parse((LIBRARY / "pipeline_parallel.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"threading", "concurrent.futures", "_thread"}, imported


def test_notebook_cells_import_only_what_they_use():
    """A learner reads a notebook's import cell as its table of contents: no name there that no cell uses.
    (%%ranks cells run on the ranks, in their own namespace: they import what they need themselves.)"""
    notebooks = sorted(str(p) for p in (REPO / "notebooks").glob("*.ipynb"))
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F401",
                           *notebooks], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-1000:]
