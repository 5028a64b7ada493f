"""nbval's markers live in cell tags (nbval honours nbval-ignore-output, nbval-check-output, nbval-skip and
raises-exception), not in comments a learner reads."""

import json
import re

import pytest

from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
NBVAL_TAGS = {"nbval-ignore-output", "nbval-check-output", "nbval-skip", "raises-exception"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_carries_an_nbval_comment_and_every_nbval_tag_is_one_nbval_knows(path):
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        assert not re.search(r"^\s*#\s*(NBVAL|PYTEST_VALIDATE)_", source, re.M), f"cell {index}: marker in a comment"
        tags = set(cell["metadata"].get("tags", []))
        assert not {t for t in tags if t.startswith("nbval")} - NBVAL_TAGS, f"cell {index}: unknown tag {tags}"
