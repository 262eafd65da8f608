"""In a real browser: JupyterLab with the server extension, driven by Playwright on the system's
Chromium. A newcomer's path: open a notebook, ``%load_ext``, run a ``%%singularity`` cell with no
configuration, and use the widget's buttons. Screenshots go to tests/artifacts/."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from jupyter_helpers import ROOT, JupyterProcess

ARTIFACTS = ROOT / "tests" / "artifacts"
#: The loop sleeps so a person (or this test) has time to click; each iteration is a safe point.
CELL = ("%%singularity --no-wait --name browser-{tag}\n"
        "import time\n"
        "for i in range(3000):\n"
        "    print('tick', i, flush=True)\n"
        "    time.sleep(0.05)\n"
        "i")


def find_chromium() -> str | None:
    for candidate in (os.environ.get("SINGULARITY_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium not found (apt-get install chromium, or set SINGULARITY_CHROMIUM): "
                             "the real-browser test of the widget cannot run here")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    jp = JupyterProcess("lab", tmp_path_factory.mktemp("lab"), "--LabApp.news_url=None",
                        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
    yield jp
    jp.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                                              "--disable-background-networking"])
        yield b
        b.close()


def open_notebook(lab: JupyterProcess, browser, tag: str):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%load_ext jupyter_ext"),
                                         nbformat.v4.new_code_cell(CELL.format(tag=tag))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, lab.root / "work" / f"{tag}.ipynb")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(30_000)
    # A workspace of its own: Lab would otherwise reopen the other tests' notebooks beside it.
    page.goto(f"{lab.url}/lab/workspaces/{tag}/tree/{tag}.ipynb?reset&token={lab.token}")
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=60_000)
    run_all(page)
    return page


def run_all(page, attempts: int = 3) -> None:
    """Run > Run All Cells. Lab can show the kernel idle a moment before it takes executions,
    and then drops the request: try again until the first cell has started (it is harmless)."""
    started = page.locator(".jp-NotebookPanel:visible .jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    for attempt in range(attempts):
        try:
            page.keyboard.press("Escape")  # a menu left open by an earlier attempt
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=10_000)
            page.locator('li[data-command="runmenu:run-all"]').click(timeout=10_000)
            started.first.wait_for(timeout=10_000)
            return
        except Exception:
            if attempt == attempts - 1:
                raise


def widget(page):
    """The job widget of the notebook in view."""
    return page.locator(".jp-NotebookPanel:visible .singularity-job")


def badge(page, state: str, timeout: float = 60_000):
    widget(page).locator(".singularity-badge", has_text=re.compile(rf"^{state}$")).wait_for(timeout=timeout)


def timeline(page, event: str, timeout: float = 30_000):
    widget(page).locator(".singularity-timeline td", has_text=re.compile(rf"^{event}$")).first.wait_for(timeout=timeout)


def click(page, button: str) -> None:
    widget(page).locator(f".singularity-{button}").click()


def backend_logs(lab: JupyterProcess) -> str:
    """The embedded backend's and agents' logs, for a failure report."""
    parts = []
    for log in sorted((lab.home / "logs").glob("*.log")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "tornado.access" not in ln]
        parts.append(f"--- {log.name}\n" + "\n".join(lines[-15:]))
    return "\n".join(parts)


def shoot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def test_widget_in_jupyterlab_shows_state_and_answers_buttons(lab, browser):
    page = open_notebook(lab, browser, "controls")
    try:
        badge(page, "running")
        widget(page).locator(".singularity-progress", has_text="log line").wait_for()
        click(page, "preempt")
        badge(page, "(preempting|preempted)", timeout=5_000)
        timeline(page, "preempting", timeout=5_000)
        click(page, "cancel")
        badge(page, "cancelled")
        timeline(page, "cancelled")
        assert widget(page).locator(".singularity-preempt").is_disabled()
        shoot(page, "jupyter-browser-controls.png")
    except Exception:
        shoot(page, "jupyter-browser-controls-FAILED.png")
        print(backend_logs(lab))
        raise
    finally:
        page.close()


def test_preempt_and_resume_from_the_widget(lab, browser):
    page = open_notebook(lab, browser, "resume")
    try:
        badge(page, "running")
        widget(page).locator(".singularity-progress", has_text="log line").wait_for()
        click(page, "preempt")
        badge(page, "preempted")
        timeline(page, "preempted")
        click(page, "resume")
        timeline(page, "resumed")
        badge(page, "running")
        shoot(page, "jupyter-browser-preempt-resume.png")
        click(page, "cancel")
        badge(page, "cancelled")
    except Exception:
        shoot(page, "jupyter-browser-preempt-resume-FAILED.png")
        print(backend_logs(lab))
        raise
    finally:
        page.close()
