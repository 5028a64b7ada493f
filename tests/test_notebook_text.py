"""What a learner reads in the notebooks fits a laptop: JupyterLab's notebook pane on a 1366-pixel screen, with
the file browser open, shows about 100 monospace characters before a diagram must scroll sideways."""

import json
import re

import pytest

from conftest import REPO

PANE_CHARACTERS = 100
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_diagrams_and_code_in_the_prose_fit_a_laptop_pane(path):
    wide = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for block in re.findall(r"```[^\n]*\n(.*?)```", "".join(cell["source"]), re.S):
            wide += [f"cell {index}: {line[:50]}… ({len(line)})" for line in block.splitlines()
                     if len(line) > PANE_CHARACTERS]
    assert not wide, f"wider than {PANE_CHARACTERS} characters: {wide}"
