"""End to end, as a learner: real JupyterLab in headless Chromium opens every notebook fresh (no raw widget text,
no answer on screen, no prediction's reveal showing anything), runs it from the menu (each reveal then asks for a
guess first, and no prediction's answer is anywhere on the page above its reveal, before or after the run), locks
in a guess for each prediction, wrong and right in turn, and re-runs its reveal (the same answer, the right
verdict), moves one control of its explorer and sees the figure change; in notebook 00 it also answers the
exercise wrong and then right, asks for a world far beyond the machine, and stops a long %%ranks cell with the
stop button.

Needs Debian's `chromium` (`.ci/run` installs it) and the `playwright` package, which drives that system
browser (no browser download). Skipped where chromium is missing, unless COURSE_REQUIRE_BROWSER=1 (as in CI).
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from conftest import REPO, gone
from course_lib.presentation.predict import format_value

pytestmark = pytest.mark.browser   # run apart with: pytest -m browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
        raise RuntimeError("COURSE_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
    pytest.skip("no chromium on PATH: the browser test is skipped", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of the course (so autosave cannot touch the real notebooks), with a home
    of its own: the user's saved workspace (other notebooks open, say) and settings must not change what the
    test sees, and the run must not write workspaces, runtime or kernel files into the user's home."""
    tmp_path = tmp_path_factory.mktemp("lab")
    for folder in ("notebooks", "labs"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    state = tmp_path / "jupyter"  # JupyterLab's and the kernels' own files, instead of ~/.jupyter and friends
    # Render every cell (JupyterLab 4 by default renders only the cells in view).
    settings = state / "user-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    news = state / "user-settings" / "@jupyterlab" / "apputils-extension"  # no "get the news?" pop-up
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    # Kernel specs, lab extensions (ipywidgets) and server extensions are still found in the environment
    # (sys.prefix/share/jupyter, sys.prefix/etc/jupyter); only the per-user places move.
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_DATA_DIR=str(state / "data"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"), IPYTHONDIR=str(state / "ipython"))
    port, token = free_port(), secrets.token_hex(8)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}", "--ServerApp.ip=127.0.0.1",
         f"--LabApp.user_settings_dir={state / 'user-settings'}", f"--LabApp.workspaces_dir={state / 'workspaces'}",
         "--LanguageServerManager.autodetect=False"],  # else jupyter-lsp runs `npm prefix -g`: a log in ~/.npm
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                api(url, token, "status")
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not start"
                time.sleep(0.3)
        yield url, token, state, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def api(url, token, path):
    with urllib.request.urlopen(f"{url}/api/{path}?token={token}", timeout=5) as reply:
        return json.load(reply)


def kernel_state(url, token):
    sessions = api(url, token, "sessions")
    return sessions[0]["kernel"]["execution_state"] if sessions else None


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


NOTEBOOKS = sorted(path.name for path in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDGET_REPR = re.compile(r"\b(VBox|HBox|SelectionSlider|Dropdown|ToggleButtons|Output|interactive|IntSlider|FloatSlider|FloatLogSlider)\(")  # a widget as raw text
ERROR_LINE = re.compile(r"^\w+(?:Error|Exception)\b.*$", re.M)


def expected_errors(name: str) -> list[str]:
    """The error lines a notebook shows on purpose (its committed outputs, which nbval keeps true): a bad
    batch, heads that do not split, a world that does not factor ... Any other error in the browser is a bug."""
    lines = []
    for cell in json.loads((REPO / "notebooks" / name).read_text())["cells"]:
        for output in cell.get("outputs", []):
            text = "\n".join(output.get("traceback", [])) + "".join(output.get("text", ""))
            text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # tracebacks carry terminal colours
            lines += ERROR_LINE.findall(text)
    return lines


@pytest.fixture(autouse=True)
def no_orphans(lab):
    """The server lives for the whole module; everything it started for one test (kernels, their ranks) must be
    gone once the test has shut its kernel down."""
    yield
    server = psutil.Process(lab[3])
    left = lambda: [p for p in server.children(recursive=True) if p.is_running() and p.status() != "zombie"]  # noqa: E731
    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == [], "processes left behind"


@pytest.fixture(scope="module")
def browser(lab):
    _, _, state, _ = lab
    with sync_api.sync_playwright() as playwright:
        # Chromium's profile is a temporary one, but it still writes crash reports and dconf files under the
        # home directory: give it one of its own as well.
        home = state / "browser-home"
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"],
            env=dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
                     XDG_CACHE_HOME=str(home / ".cache")))
        yield browser
        browser.close()


@pytest.fixture
def page(lab, browser):
    """A fresh tab; afterwards its kernel is shut down and a screenshot kept (ignored by git; handy when a
    check fails)."""
    url, token, *_ = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield page
    page.screenshot(path=str(REPO / ".pytest-browser.png"))
    page.close()
    for session in api(url, token, "sessions"):
        request = urllib.request.Request(f"{url}/api/sessions/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=10).close()


def open_fresh(page, lab, name: str) -> None:
    """Open a notebook as a learner finds it (``reset``: no tabs restored from an earlier visit)."""
    url, token, *_ = lab
    page.goto(f"{url}/lab/tree/notebooks/{name}?reset&token={token}")
    # The toolbar says "idle" before a kernel exists: ask the server instead.
    wait_for(lambda: kernel_state(url, token) == "idle", 60, "the notebook's kernel")
    assert len(api(url, token, "sessions")) == 1, "other notebooks are open too (a saved workspace restored?)"
    wait_for(lambda: page.locator(".jp-OutputArea-output").count() > 0, 30, "the committed outputs")


def check_nothing_raw_and_no_answer_shown(page, name: str) -> None:
    """What a learner sees before running anything: no widget as raw text, no exercise marked correct."""
    shown = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    assert not WIDGET_REPR.search(shown), f"{name}: a widget shown as raw text: {WIDGET_REPR.search(shown)[0]}..."
    assert "✓" not in shown, f"{name}: an exercise shows as solved before the learner has done anything"


def code_cell_sources(name: str) -> list[str]:
    """The source of each code cell of the notebook, in order (as JupyterLab lays out its code cells)."""
    cells = json.loads((REPO / "notebooks" / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def check_no_reveal_shows_an_answer(page, name: str, *, ran: bool) -> None:
    """Predict first: opened fresh, no reveal cell shows anything; after Run All (no guess locked in), each
    says to lock in a guess first and shows no "you predicted" line."""
    # Found by position, not by their text: the editor draws only the lines of a long cell that are in view.
    sources = code_cell_sources(name)
    cells = page.locator(".jp-CodeCell")
    assert cells.count() == len(sources), f"{name}: {cells.count()} code cells on screen, {len(sources)} in the file"
    for i in [i for i, source in enumerate(sources) if ".reveal(" in source]:
        said = cells.nth(i).locator(".jp-OutputArea").inner_text()
        if ran:
            assert "lock in a guess first" in said and "you predicted" not in said, f"{name}: {said[:200]}"
        else:
            assert said.strip() == "", f"{name}: a reveal shows output before anything ran: {said[:200]}"


PREDICTION = re.compile(r"^(\w+) = (?:predict\.)?Prediction\(", re.M)


def predictions(name: str) -> list[tuple[str, int, int]]:
    """Each prediction of a notebook: its variable, the code cell that makes it and the one that reveals it."""
    sources = code_cell_sources(name)
    found = []
    for made, source in enumerate(sources):
        for variable in PREDICTION.findall(source):
            reveal = next(i for i in range(made, len(sources)) if f"{variable}.reveal(" in sources[i])
            found.append((variable, made, reveal))
    return found


def rendered_cells(page) -> list[str]:
    """What the page shows of every cell (markdown as rendered, code with its outputs), in order."""
    return page.locator(".jp-Notebook .jp-Cell").evaluate_all("cells => cells.map(cell => cell.innerText)")


def kernel_answers(page) -> dict[str, tuple[float, float, float]]:
    """Each Prediction's answer (the number its reveal was given) and the range its box takes, asked of the
    kernel in a new cell at the end, after Run All."""
    add_cell(page, "import json\nfrom course_lib.presentation.predict import Prediction\nprint('ANSWERS', json.dumps("
                   "{k: (v.answer, v.low, v.high) for k, v in dict(globals()).items() if isinstance(v, Prediction) and "
                   "not k.startswith('_')}))")   # not IPython's _, __ and _13, the same objects again
    said = page.locator(".jp-OutputArea-output", has_text="ANSWERS {")
    wait_for(lambda: said.count() == 1, 60, "the answers")
    return {k: tuple(v) for k, v in json.loads(said.inner_text().split("ANSWERS", 1)[1]).items()}


def check_no_answer_above_its_reveal(name: str, shown: list[str], answers: dict) -> None:
    """No prediction's answer, as its reveal would print it, in any cell from the top through its reveal cell:
    rendered text, outputs and every line of the code (the editor draws only the lines in view). An answer of one
    digit is too common to look for (it is still held back by the reveal and by working())."""
    cells = json.loads((REPO / "notebooks" / name).read_text())["cells"]
    code_cells = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code"]
    for variable, _, reveal in predictions(name):
        number = format_value(answers[variable][0])
        if sum(c.isdigit() for c in number) < 2:
            continue
        last = code_cells[reveal]
        sources = ["".join(cell["source"]) for cell in cells[:last + 1]
                   if not cell.get("metadata", {}).get("jupyter", {}).get("source_hidden")]
        page_text = "\n".join(shown[:last + 1] + sources)
        found = re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", page_text)
        assert not found, (f"{name}: {variable}'s answer {number} is on the page before its reveal: "
                           f"...{page_text[max(found.start() - 120, 0):found.end() + 40]}...")


def run_cell(page, lab, cell, seconds: float = 120) -> None:
    """Select a cell by its prompt and run it (Ctrl+Enter); wait for its new execution count."""
    url, token, *_ = lab
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text()
    prompt.click()
    page.keyboard.press("Control+Enter")
    wait_for(lambda: re.search(r"\[\d+\]", prompt.inner_text()) and prompt.inner_text() != before
             and kernel_state(url, token) == "idle", seconds, "the cell to run")


def guess_and_reveal(page, lab, made: int, reveal: int, guess: float) -> str:
    """Run the prediction's cell again (a fresh box), type ``guess``, lock it in, re-run the reveal: its output."""
    cells = page.locator(".jp-CodeCell")
    run_cell(page, lab, cells.nth(made))
    box = cells.nth(made).locator(".widget-text input")
    box.fill(f"{guess:.12g}")
    box.press("Enter")
    cells.nth(made).get_by_role("button", name="lock it in").click()
    wait_for(lambda: "Locked in" in cells.nth(made).locator(".jp-OutputArea").inner_text(), 20, "the guess locked in")
    run_cell(page, lab, cells.nth(reveal))
    said = cells.nth(reveal).locator(".jp-OutputArea")
    try:
        wait_for(lambda: "you predicted" in said.inner_text(), 30, "the reveal's verdict")
    except AssertionError:
        raise AssertionError(f"no verdict after a guess of {guess:g}: the reveal says {said.inner_text()[:500]!r}")
    return said.inner_text()


VERDICT = re.compile(r"you predicted (-?[\d,.]+)[^;]*; .*?: (-?[\d,.]+)")


def check_reveals_after_a_guess(page, lab, name: str, answers: dict) -> None:
    """Each reveal, re-run after a guess: the answer Run All gave (a measured time may move by a quarter; stale
    state, a folder left from the last run, moves it more) and the verdict its numbers call for. The guesses
    alternate, wrong (the end of the box's range farther from the answer) then right (the answer as printed), so
    that a notebook with two predictions or more shows both verdicts; one re-run each, because some reveals
    measure for seconds."""
    for index, (variable, made, reveal) in enumerate(predictions(name)):
        answer, low, high = answers[variable]
        wrong = low if abs(answer - low) > abs(answer - high) else high
        guess = float(format_value(answer).replace(",", "")) if index % 2 else wrong
        said = guess_and_reveal(page, lab, made, reveal, guess)
        guessed, stated = (float(x.replace(",", "")) for x in VERDICT.search(said).groups())
        assert abs(stated - answer) <= 0.25 * abs(answer), (f"{name}: {variable} re-run gives {stated:g}, "
                                                            f"Run All gave {answer:g}: {said[:300]}")
        close = abs(guessed - stated) <= 0.05 * abs(stated)
        verdicts = ("within 5%", "exactly right") if close else ("off by",)
        assert any(v in said for v in verdicts), f"{name}: {variable} guessed {guess:g}: {said[:300]}"


def clear_and_run_all(page, lab, name: str, seconds: float = 300) -> None:
    """Clear every output, then run every cell, through the menus as a learner would; every cell ran (Run All
    stops at an error, except in cells tagged raises-exception) and only the errors shown on purpose appear."""
    url, token, *_ = lab
    outputs = page.locator(".jp-OutputArea-output")
    page.get_by_role("menuitem", name="Edit", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Clear Outputs of All Cells")).click()
    assert outputs.count() == 0
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()
    queued = page.locator(".jp-InputPrompt", has_text="*")  # "[*]:" marks a cell queued or running
    wait_for(lambda: queued.count() > 0, 30, "run-all to start")
    unrun = page.locator(".jp-CodeCell .jp-InputPrompt", has_text=re.compile(r"^\s*\[\s*\]:\s*$"))

    def finished() -> bool:
        """Every cell ran; or nothing is queued and the kernel stays idle (Run All stopped at an error). Between
        two cells the prompts and the kernel can both look done for a moment: look twice, a few seconds apart."""
        if queued.count() or kernel_state(url, token) != "idle":
            return False
        if unrun.count() == 0:
            return True
        time.sleep(5)
        return queued.count() == 0 and kernel_state(url, token) == "idle"

    wait_for(finished, seconds, f"{name} to finish")
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
    errors = [line for text in outputs.all_inner_texts() for line in ERROR_LINE.findall(text)]
    assert not [p for p in prompts if re.fullmatch(r"\[\s*\]:", p.strip())], f"{name}: Run All stopped at {errors}"
    # A cell's output and its "done" reply travel on two channels: on a busy machine the prompt can change
    # before the last output is drawn.
    last = page.locator(".jp-CodeCell").last.locator(".jp-OutputArea-output")
    if json.loads((REPO / "notebooks" / name).read_text())["cells"][-1].get("outputs"):
        wait_for(lambda: last.count() > 0, 30, "the last cell's output")
    allowed = expected_errors(name)
    shown = [line for text in outputs.all_inner_texts() for line in ERROR_LINE.findall(text)]
    same = lambda line: re.sub(r"ranks? \[?[\d, ]+\]?", "rank N", line)[:60]  # noqa: E731  whichever rank failed first
    unexpected = [line for line in shown if same(line) not in {same(a) for a in allowed}]
    assert not unexpected, f"{name}: errors not shown on purpose: {unexpected}"


def explorer_cell(page):
    """The cell that shows the notebook's explorer panel (it calls ``explorers.`` and shows widgets: 06 also
    builds a panel it never displays, to check it)."""
    cells = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text="explorers."))
    return cells.filter(has=page.locator(".jupyter-widgets")).last


def move_one_control_and_see_the_figure_change(page, name: str) -> None:
    """Change the explorer's first dropdown (or slider, or toggle button) and wait for its figure to change."""
    cell = explorer_cell(page)
    cell.scroll_into_view_if_needed()
    figure = cell.locator(".widget-output img").first
    wait_for(lambda: figure.count() == 1, 60, f"{name}: the explorer's figure")
    before = figure.get_attribute("src")
    dropdowns, sliders = cell.locator(".widget-dropdown select"), cell.locator(".widget-slider .noUi-handle")
    toggles = cell.locator(".widget-toggle-buttons button:not(.mod-active)")
    if dropdowns.count():
        select = dropdowns.first
        current = select.input_value()
        other = next(v for v in select.locator("option").evaluate_all("os => os.map(o => o.value)") if v != current)
        select.select_option(other)
    elif sliders.count():
        readout = cell.locator(".widget-readout").first
        shown = readout.inner_text()
        sliders.first.focus()
        page.keyboard.press("ArrowRight")
        time.sleep(1)
        if readout.inner_text() == shown:        # at its maximum already: the other way
            page.keyboard.press("ArrowLeft")
    else:
        toggles.first.click()
    wait_for(lambda: figure.count() == 1 and figure.get_attribute("src") != before, 120,
             f"{name}: the explorer's figure to change")


def add_cell(page, code: str) -> None:
    """A new cell at the end of the notebook, typed and run."""
    page.locator(".jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # new cell below, in edit mode after Enter
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")


@pytest.mark.parametrize("name", [n for n in NOTEBOOKS if not n.startswith("00")])
def test_a_learner_opens_a_notebook_runs_it_from_the_menu_and_moves_its_explorer(lab, page, name):
    open_fresh(page, lab, name)
    check_nothing_raw_and_no_answer_shown(page, name)
    check_no_reveal_shows_an_answer(page, name, ran=False)
    fresh = rendered_cells(page)
    clear_and_run_all(page, lab, name)
    check_no_reveal_shows_an_answer(page, name, ran=True)
    if predictions(name):
        ran = rendered_cells(page)
        answers = kernel_answers(page)
        for shown in (fresh, ran):
            check_no_answer_above_its_reveal(name, shown, answers)
        check_reveals_after_a_guess(page, lab, name, answers)
    if "explorers." in (REPO / "notebooks" / name).read_text():   # notebooks with an explorer panel
        move_one_control_and_see_the_figure_change(page, name)


def test_a_learner_works_through_notebook_00_and_its_ranks(lab, page):
    url, token, *_ = lab
    name = "00_training_step.ipynb"
    open_fresh(page, lab, name)
    check_nothing_raw_and_no_answer_shown(page, name)
    clear_and_run_all(page, lab, name, seconds=180)
    outputs = page.locator(".jp-OutputArea-output")
    assert outputs.filter(has_text="all ranks stopped").count() == 1
    assert outputs.filter(has_text="every rank holds the single-process mean").count() == 1

    # Move the learning-rate slider one notch: a new curve is trained and the plot changes.
    move_one_control_and_see_the_figure_change(page, name)
    assert "0.03" in explorer_cell(page).locator(".widget-readout").first.inner_text()

    # The exercise, answered wrong (a sum, in place): a hint, and no answer until the learner asks; then right.
    exercise = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text="def mean_over_ranks")).first
    said = lambda: exercise.locator(".jp-OutputArea").inner_text()  # noqa: E731

    def answer(code: str) -> None:
        exercise.locator(".cm-content").click()
        page.keyboard.press("Control+a")
        page.keyboard.insert_text(code)
        page.keyboard.press("Shift+Enter")

    answer("def mean_over_ranks(rank, world_size, value):\n    dist.all_reduce(value)\n    return value\n\n"
           "exercises.check_mean_over_ranks(mean_over_ranks);")
    wait_for(lambda: "stuck?" in said(), 60, "the hint to a wrong answer")
    assert "✓" not in said() and "clone" not in said(), said()   # no pass, and not the reference answer
    answer("def mean_over_ranks(rank, world_size, value):\n    total = value.clone()\n    dist.all_reduce(total)\n"
           "    return total / world_size\n\nexercises.check_mean_over_ranks(mean_over_ranks);")
    wait_for(lambda: "✓ correct" in said(), 60, "the right answer confirmed")

    # A world far beyond this machine is refused at once, saying what the machine has.
    add_cell(page, "%ranks start 100000")
    refusal = page.locator(".jp-Cell", has_text="%ranks start 100000").locator(".jp-OutputArea-output")
    wait_for(lambda: "100000" in " ".join(refusal.all_inner_texts()) and "cores" in " ".join(refusal.all_inner_texts()),
             30, "the refusal of 100000 ranks")

    # A long %%ranks cell, then the stop button.
    add_cell(page, "%ranks start 2\nimport os\nprint('kernel', os.getpid())")
    wait_for(lambda: page.get_by_text("2 ranks started").count() == 1, 60, "ranks to start")
    add_cell(page, "%%ranks\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)")
    long_cell = page.locator(".jp-Cell", has_text="time.sleep(120)")
    pids_shown = lambda: [int(p) for p in re.findall(r"── rank \d ──\s+(\d+)", long_cell.inner_text())]  # noqa: E731
    wait_for(lambda: len(pids_shown()) == 2, 30, "both ranks' process ids")
    pids = pids_shown()
    page.locator("jp-button[data-command='notebook:interrupt-kernel']").click()
    wait_for(lambda: page.get_by_text("KeyboardInterrupt").count() >= 1, 20, "the interrupt")
    wait_for(lambda: kernel_state(url, token) == "idle", 20, "the kernel to be idle")

    # The kernel is usable, the ranks still answer, and %ranks stop leaves no process behind.
    add_cell(page, "%ranks stop\nprint('still here:', 6 * 7)")
    wait_for(lambda: page.get_by_text("still here: 42").count() == 1, 30, "the kernel to answer")
    assert gone(pids), "rank processes left behind"

    # An interactive (plotly) figure renders in the page: 4 stages × 8 micro-batches × (F, B) = 64 bars.
    add_cell(page, "from course_lib.presentation import interactive\nfrom course_lib.pipeline_parallel import simulate\n"
                   "interactive.show(interactive.pipeline_gantt(simulate('1f1b', 4, 8, 1.0, 2.0)))")
    bars = page.locator(".js-plotly-plot g.point")
    wait_for(lambda: bars.count() == 64, 30, "the plotly Gantt chart's 64 bars")
