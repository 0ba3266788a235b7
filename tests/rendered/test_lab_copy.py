"""A learner copy as a learner sees it: JupyterLab with jupyterlab-myst, in headless
Chromium, against a JupyterLab server of our own on 127.0.0.1 (no other host).

Chapter 0's copy is opened before any cell has run: every prose number reads as a
short note naming the cell that computes it (never Python code, never an error). Then
Run > Run All Cells, as a learner would click it: the numbers are the learner's own
(the backend is gloo). Chapter 4's copy: every citation is author and year, linked to
an entry of its References cell. Screenshots of chapter 0 before and after go to
`_build/screenshots/lab-00-before.png` and `lab-00-after.png`.

The Chinese copies (`make lab LANG=zh_CN`): chapter 0's prose is Chinese, JupyterLab's
menus are (its zh_CN language pack), and a wrong answer, typed in as a learner would,
is answered in Chinese by Run > Run All Cells (`lab-zh-00-wrong.png`).

Also: `jupyter labextension list` calls the pinned jupyterlab-myst compatible.

Needs the `lab` extra (`make check-book` installs it) and Chromium; skipped without
them, failed under DTLIB_REQUIRE_BOOK=1 (as `make check-book` runs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cdp_pipe import INSTALL_HINT, Browser, find_chromium

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("DTLIB_BOOK_HTML", ROOT / "_build" / "html")).resolve() \
    .parent / "screenshots"
REQUIRED = os.environ.get("DTLIB_REQUIRE_BOOK") == "1"
JUPYTER = Path(sys.executable).parent / "jupyter"
CH0, CH4 = "00_hello_distributed.ipynb", "04_zero_fsdp.ipynb"

# Every markdown cell's rendered text (the hidden editor's source left out), whether
# the notebook has finished loading, and each code cell's prompt.
STATE_JS = r"""
(() => {
  // The open notebook only: an earlier tab stays in the page, hidden.
  const NB = '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook';
  const md = [...document.querySelectorAll(NB + ' .jp-MarkdownCell')];
  const text = md.map(cell => {
    const copy = cell.cloneNode(true);
    copy.querySelectorAll('.jp-InputArea-editor, .cm-editor').forEach(e => e.remove());
    return copy.textContent;
  });
  const links = [...document.querySelectorAll(NB + ' .jp-MarkdownCell a')]
    .filter(a => (a.getAttribute('href') || '').startsWith('#ref-'))
    .map(a => [a.textContent, a.getAttribute('href').slice(1),
               !!document.getElementById(a.getAttribute('href').slice(1))]);
  const code = [...document.querySelectorAll(NB + ' .jp-CodeCell')];
  const prompts = code.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent);
  // An {eval} role left as code (its expression shown), or drawn as an error.
  const errors = [
    ...[...document.querySelectorAll(NB + ' .jp-MarkdownCell code')]
      .map(e => e.textContent).filter(t => /glued\(|__import__/.test(t)),
    ...[...document.querySelectorAll(NB + ' .jp-MarkdownCell ' +
        '[data-mime-type="application/vnd.jupyter.stderr"]')].map(e => e.textContent)];
  return {md: text, links, prompts, errors,
          busy: !!document.querySelector('.jp-Notebook-ExecutionIndicator[data-status="busy"]')};
})()
"""

# The box of a visible element found by CSS selector and text: where to click.
BOX_JS = r"""
(() => {
  const all = [...document.querySelectorAll(%(selector)s)];
  const el = all.find(e => e.textContent.trim() === %(text)s && e.offsetParent !== null);
  if (!el) return null;
  const r = el.getBoundingClientRect();
  return [r.x + r.width / 2, r.y + r.height / 2];
})()
"""

NOTE = re.compile(r"\[run (?:the cells? (?:above|below)|“[^”]+”)\]")


def _unavailable() -> str | None:
    try:
        import jupyterlab  # noqa: F401
        import jupyterlab_myst  # noqa: F401
    except ImportError:
        return "no JupyterLab with jupyterlab-myst: install the lab extra (make lab)"
    if find_chromium() is None:
        return f"no Chromium to open JupyterLab: {INSTALL_HINT}"
    return None


@contextlib.contextmanager
def _lab_server(home: Path, copies: Path, trusted: list[str], locale: str = "en"):
    """A JupyterLab server over ``copies`` (its own config, data, settings and
    workspace folders; JupyterLab's own language ``locale``), and a browser that may
    reach only it."""
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No "would you like news?" prompt over the page, no update check.
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    if locale != "en":  # what make lab LANG=zh_CN writes
        from dtlib.exercises.lab import write_settings

        write_settings(str(home / "settings"), locale)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    env.pop("DTLIB_STRICT_WARNINGS", None)  # the learner's kernel, as make lab runs it
    env.pop("DTLIB_LANG", None)  # the copy sets its own language
    subprocess.run([str(JUPYTER), "trust", *(str(copies / n) for n in trusted)],
                   env=env, check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [str(JUPYTER), "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={copies}", f"--LabApp.user_settings_dir={home / 'settings'}",
         f"--LabApp.workspaces_dir={home / 'workspaces'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=copies)
    browser = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start: "
                                       + (home / "server.log").read_text()[-2000:])
                time.sleep(0.5)
        browser = Browser.warm(find_chromium(), loopback=True)
        yield browser, f"http://127.0.0.1:{port}", token
    finally:
        if browser is not None:
            browser.close()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _require_lab() -> None:
    reason = _unavailable()
    if reason:
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab over fresh English learner copies."""
    _require_lab()
    from dtlib.exercises.strip import strip_tree

    home = tmp_path_factory.mktemp("lab")
    copies = home / "exercises"
    strip_tree(ROOT / "notebooks", copies)
    with _lab_server(home, copies, [CH0, CH4]) as served:
        yield served


def _open(browser: Browser, base: str, token: str, name: str, cells: int) -> dict:
    """Open a copy and wait until each of its markdown cells is rendered."""
    browser.send("Page.navigate", url=f"{base}/lab/tree/{name}?token={token}")
    deadline = time.monotonic() + 120
    while True:
        time.sleep(1)
        state = browser.evaluate(STATE_JS)
        if len(state["md"]) == cells and all(t.strip() for t in state["md"]):
            time.sleep(2)  # the last expressions restored from the saved results
            return browser.evaluate(STATE_JS)
        assert time.monotonic() < deadline, \
            f"{name}: {len(state['md'])} of {cells} markdown cells rendered"


def _click(browser: Browser, selector: str, text: str) -> None:
    box = None
    for _ in range(40):
        box = browser.evaluate(BOX_JS % {"selector": json.dumps(selector),
                                         "text": json.dumps(text)})
        if box:
            break
        time.sleep(0.25)
    assert box, f"no visible {selector} reading {text!r}"
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        browser.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1],
                     button="left", clickCount=1)


def _show(browser: Browser, words: str) -> None:
    """Scroll the open notebook to the markdown cell that reads ``words``."""
    browser.evaluate("""(async () => {
      const cells = [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownCell')];
      const cell = cells.find(c => c.textContent.includes(%s));
      if (cell) cell.scrollIntoView({block: "center"});
      await new Promise(r => setTimeout(r, 500));
    })()""" % json.dumps(words))


def _copy(name: str) -> dict:
    from dtlib.exercises.references import load
    from dtlib.exercises.strip import book_bibliography, strip_notebook

    refs = load(book_bibliography(ROOT / "notebooks"))
    return strip_notebook(json.loads((ROOT / "notebooks" / name).read_text()), refs)[0]


def _markdown_cells(nb: dict) -> int:
    return sum(c["cell_type"] == "markdown" for c in nb["cells"])


def test_jupyterlab_calls_the_pinned_myst_extension_compatible() -> None:
    if _unavailable() and not REQUIRED:
        pytest.skip(_unavailable())
    out = subprocess.run([str(JUPYTER), "labextension", "list"], capture_output=True,
                         text=True, timeout=120)
    listing = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    line = next(ln for ln in listing.splitlines() if "jupyterlab-myst" in ln)
    assert "enabled" in line and "OK" in line, listing
    assert "not compatible" not in listing, listing


# Chapter 4 opens first: after chapter 0 has run, leaving its page would ask "leave
# the page?" (its notebook has changed).
def test_chapter_4_citations_link_to_its_references(lab) -> None:
    browser, base, token = lab
    nb = _copy(CH4)
    state = _open(browser, base, token, CH4, _markdown_cells(nb))
    text = "\n".join(state["md"])
    assert "{cite" not in text and "Citation Not Found" not in text
    assert not state["errors"], state["errors"]
    assert state["links"], "no citation link rendered"
    for label, target, found in state["links"]:
        assert re.fullmatch(r".+, \d{4}[a-z]?", label), label  # author, year
        assert found, f"{label}: no element #{target} on the page"
    assert "Rajbhandari et al., 2020" in text
    assert re.search(r"Samyam Rajbhandari, .* \(2020\)\. ZeRO", state["md"][-1])


def test_chapter_0_reads_before_and_after_its_cells_run(lab) -> None:
    browser, base, token = lab
    nb = _copy(CH0)
    before = _open(browser, base, token, CH0, _markdown_cells(nb))
    SHOTS.mkdir(parents=True, exist_ok=True)
    _show(browser, "In this kernel the backend is")
    browser.capture().save(SHOTS / "lab-00-before.png")
    text = "\n".join(before["md"])
    assert not before["errors"], before["errors"]
    for bad in ("glued(", "__import__", "{eval}", "{glue"):
        assert bad not in text, bad
    expected = sum(len(e) for c in nb["cells"]
                   for e in [c["metadata"].get("user_expressions", [])])
    assert len(NOTE.findall(text)) == expected  # each number: its note, nothing else
    assert "In this kernel the backend is [run the cell above]" in text

    _click(browser, ".lm-MenuBar-itemLabel", "Run")
    _click(browser, ".lm-Menu-itemLabel", "Run All Cells")
    code_cells = sum(c["cell_type"] == "code" for c in nb["cells"])
    deadline = time.monotonic() + 240
    while True:
        time.sleep(2)
        state = browser.evaluate(STATE_JS)
        done = [p for p in state["prompts"] if re.fullmatch(r"\[\d+\]:", p or "")]
        if len(done) == code_cells and not state["busy"]:
            break
        assert time.monotonic() < deadline, f"ran {len(done)} of {code_cells} cells"
    time.sleep(2)
    after = browser.evaluate(STATE_JS)
    _show(browser, "In this kernel the backend is")
    browser.capture().save(SHOTS / "lab-00-after.png")
    text = "\n".join(after["md"])
    assert not after["errors"], after["errors"]
    assert "In this kernel the backend is gloo" in text
    for bad in ("glued(", "__import__"):
        assert bad not in text, bad
    # Run in order, a number computed above its sentence is now the learner's own;
    # only a sentence that comes before its cell still reads "run the cell below".
    left = NOTE.findall(text)
    assert all(n == "[run the cell below]" for n in left), left


# The Chinese copies (make lab LANG=zh_CN): the prose from the catalogs, JupyterLab's
# menus from its zh_CN language pack, and a wrong answer answered in Chinese.

OUTPUTS_JS = r"""
(() => [...document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output')]
    .map(e => e.textContent))()
"""
WRONG = "return float(world_size)  # a learner's wrong answer: one rank's share"


@pytest.fixture(scope="module")
def lab_zh(tmp_path_factory):
    """JupyterLab in Chinese over fresh Chinese learner copies; chapter 0's first
    exercise answered wrongly, as a learner might."""
    _require_lab()
    from dtlib.exercises.strip import strip_tree

    home = tmp_path_factory.mktemp("lab-zh")
    copies = home / "exercises" / "zh_CN"
    strip_tree(ROOT / "notebooks", copies, lang="zh_CN")
    nb = json.loads((copies / CH0).read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code"
                and "def predict" in "".join(c["source"]))
    src = "".join(cell["source"])
    assert "raise NotImplementedError" in src, src
    cell["source"] = src.replace("raise NotImplementedError", WRONG, 1)
    (copies / CH0).write_text(json.dumps(nb, ensure_ascii=False, indent=1))
    with _lab_server(home, copies, [CH0], locale="zh_CN") as served:
        yield served, nb


def test_a_chinese_copy_answers_a_wrong_answer_in_chinese(lab_zh) -> None:
    (browser, base, token), nb = lab_zh
    state = _open(browser, base, token, CH0, _markdown_cells(nb))
    text = "\n".join(state["md"])
    assert re.search(r"[\u4e00-\u9fff]", text), "the copy's prose is not Chinese"
    assert not state["errors"], state["errors"]
    menus = browser.evaluate(
        "[...document.querySelectorAll('.lm-MenuBar-itemLabel')].map(e => e.textContent)")
    assert "运行" in menus, f"JupyterLab's menus read {menus}"
    _click(browser, ".lm-MenuBar-itemLabel", "运行")
    _click(browser, ".lm-Menu-itemLabel", "运行所有单元格")
    deadline = time.monotonic() + 240
    while True:
        time.sleep(2)
        outputs = browser.evaluate(OUTPUTS_JS)
        wrong = [o for o in outputs if "还不对" in o or "Not yet" in o]
        if wrong:
            break
        assert time.monotonic() < deadline, f"no verdict; outputs: {outputs[-3:]}"
    time.sleep(1)
    browser.evaluate("""(async () => {
      const out = [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output')]
        .find(e => e.textContent.includes('还不对'));
      if (out) out.scrollIntoView({block: "center"});
      await new Promise(r => setTimeout(r, 500));
    })()""")
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.capture().save(SHOTS / "lab-zh-00-wrong.png")
    verdict = wrong[0]
    assert "还不对" in verdict and "Not yet" not in verdict, verdict
    assert "你预测的是" in verdict, verdict  # the checker's own sentence, translated
