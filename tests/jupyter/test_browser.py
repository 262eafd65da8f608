"""In a real browser: JupyterLab with the server extension, driven by Playwright on the system's
Chromium. A newcomer's path: open a notebook, ``%load_ext``, run a ``%%singularity`` cell with no
configuration, and use the widget's buttons *while the cell still runs* (no ``--no-wait``).
Screenshots go to the pytest tmp dir (the path is printed); the one of a preemption is copied to
docs/images/ for docs/jupyter.md when that file is missing or SINGULARITY_UPDATE_SCREENSHOTS=1."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from jupyter_helpers import ROOT, JupyterProcess, cancel_quietly

DOC_SHOT = ROOT / "docs" / "images" / "jupyter-widget-preempted.png"
#: The loop sleeps so a person (or this test) has time to click; each iteration is a safe point.
CELL = ("%%singularity --name browser-{tag}\n"
        "import time\n"
        "for i in range(3000):\n"
        "    print(f'step={{i}} loss={{1 / (i + 1)}}', flush=True)\n"
        "    time.sleep(0.05)\n"
        "i")
#: An ordinary DDP cell on 2 devices printing its loss; its value is the parameters' digest.
DDP = (ROOT / "tests" / "e2e" / "programs" / "ddp_train.py").read_text().replace(
    'int(os.environ.get("STEPS", "60"))', "200").replace(
    'print(f"step {step} loss {loss.item()!r}", flush=True)', 'print(f"step={step} loss={loss.item()!r}", flush=True)')
#: The same training, slower per step (the value does not depend on it): time to click.
SLOW_DDP = DDP.replace('float(os.environ.get("STEP_SLEEP", "0.02"))', "0.08")


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
    root = tmp_path_factory.mktemp("lab")
    news = root / "lab-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false", "checkForUpdates": false}')  # no toast over the widget
    jp = JupyterProcess("lab", root, "--LabApp.news_url=None",
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


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def open_notebook(lab: JupyterProcess, browser, tag: str, cells: list[str] | None = None):
    cells = cells or [CELL.format(tag=tag)]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in ["%load_ext jupyter_ext", *cells]])
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
    and then drops the request: try again until the first cell has started. Only then: a second
    Run All after one that was taken would queue the cells again behind the running job cell,
    whose widget would then never show (seen once on a loaded machine, where a taken request
    showed its prompt after more than 10 s)."""
    started = page.locator(".jp-NotebookPanel:visible .jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    for attempt in range(attempts):
        try:
            page.keyboard.press("Escape")  # a menu left open by an earlier attempt
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=10_000)
            page.locator('li[data-command="runmenu:run-all"]').click(timeout=10_000)
            started.first.wait_for(timeout=30_000)
            return
        except Exception:
            if started.count():  # taken after all, late
                return
            if attempt == attempts - 1:
                raise


def restart_and_run_all(page) -> None:
    """Kernel > Restart Kernel and Run All Cells: a fresh kernel and connection for cells whose
    execution requests were lost (seen on a loaded machine: every cell queued, [*], while the
    status bar said the kernel was idle; a second Run All queued them again, to no effect)."""
    page.keyboard.press("Escape")
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click(timeout=10_000)
    page.locator('li[data-command="runmenu:restart-and-run-all"]').click(timeout=10_000)
    page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)


def cell(page, index: int):
    return page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)


def widget(page, index: int = 1):
    """The job widget of cell ``index`` (0 is %load_ext) of the notebook in view."""
    return cell(page, index).locator(".singularity-job")


def badge(page, state: str, timeout: float = 60_000, index: int = 1):
    widget(page, index).locator(".singularity-badge", has_text=re.compile(rf"^{state}$")).wait_for(timeout=timeout)


def timeline(page, event: str, timeout: float = 30_000, index: int = 1):
    widget(page, index).locator(".singularity-timeline td",
                                has_text=re.compile(rf"^{event}$")).first.wait_for(timeout=timeout)


def click(page, button: str, index: int = 1) -> None:
    widget(page, index).locator(f".singularity-{button}").click()


def running(page, index: int) -> bool:
    """Whether cell ``index`` is still executing (its prompt shows [*])."""
    return cell(page, index).locator(".jp-InputPrompt").inner_text().strip().startswith("[*]")


def result(page, index: int, timeout: float = 240_000) -> str:
    out = cell(page, index).locator(".jp-OutputArea-executeResult .jp-OutputArea-output")
    out.wait_for(timeout=timeout)
    return out.inner_text().strip()


def first_job_running(page, lab: JupyterProcess, name: str) -> None:
    """The first job of a fresh backend shows ``running`` (a slow machine needs time). Seen once on
    a loaded machine: 2 minutes after a Run All the kernel had submitted nothing; if no job of
    that name exists after 60 s, the kernel is restarted and the cells run once more (said in
    the output), and the widget must then show the job."""
    from singularity_sdk import Client

    try:
        badge(page, "running", timeout=60_000)
        return
    except Exception:
        with Client(home=lab.home) as client:
            if any(job.info.name == name for job in client.jobs()):
                raise
    print(f"no job {name!r} 60 s after Run All; the cells were:\n{cells_text(page)}\n"
          "restarting the kernel and running them again")
    restart_and_run_all(page)
    badge(page, "running", timeout=90_000)


def cells_text(page) -> str:
    """Each cell's prompt and the text of its outputs, for a failure report (a screenshot shows
    only what fits the window)."""
    parts = []
    try:
        cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
        for i in range(cells.count()):
            prompt = cells.nth(i).locator(".jp-InputPrompt").first.inner_text(timeout=2_000)
            outputs = cells.nth(i).locator(".jp-OutputArea")
            text = outputs.first.inner_text(timeout=2_000) if outputs.count() else ""
            parts.append(f"--- cell {i} {prompt.strip()} outputs: {text[-1500:]!r}")
    except Exception as exc:  # the report must not hide the failure it reports
        parts.append(f"--- the cells could not be read: {exc!r}")
    return "\n".join(parts)


def backend_logs(lab: JupyterProcess) -> str:
    """What a failure report needs: every job's story as the embedded backend tells it (its
    events but the log lines), the backend's and agents' logs, and Jupyter's own (the kernel's
    errors land there)."""
    from singularity_sdk import Client, EventType

    parts = []
    try:
        with Client(home=lab.home) as client:
            for job in client.jobs():
                parts.append(f"--- job {job.id} {job.info.name!r}: {job.state}")
                logs = 0
                for ev in job.events(follow=False):
                    if ev.type == EventType.LOG:
                        logs += len(ev.lines)
                        continue
                    parts.append(f"  {ev.time:.2f} {ev.type} {str(ev.data)[:200]}  (after {logs} log lines)")
    except Exception as exc:  # the report must not hide the failure it reports
        parts.append(f"--- the backend's jobs could not be read: {exc!r}")
    for log in sorted((lab.home / "logs").glob("*.log")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "tornado.access" not in ln]
        parts.append(f"--- {log.name}\n" + "\n".join(lines[-15:]))
    parts.append("--- jupyter's log\n" + lab.log())
    return "\n".join(parts)


def cancel_all(lab: JupyterProcess) -> None:
    """Cancel what a test left running, so that a failure does not hold the devices the next
    test's cells wait for."""
    from singularity_sdk import Client

    with Client(home=lab.home) as client:
        for job in client.jobs():
            cancel_quietly(job)


def shoot(page, folder: Path, name: str, element=None) -> Path:
    path = folder / name
    (element or page).screenshot(path=str(path), **({} if element is not None else {"full_page": True}))
    print(f"screenshot: {path}")
    return path


def test_buttons_act_while_the_cell_runs(lab, browser, shots):
    page = open_notebook(lab, browser, "controls")
    try:
        first_job_running(page, lab, "browser-controls")
        widget(page).locator(".singularity-progress", has_text="log line").wait_for()
        click(page, "preempt")
        badge(page, "(preempting|preempted)", timeout=5_000)
        timeline(page, "preempting", timeout=5_000)
        assert running(page, 1), "the buttons must act while the cell is still running"
        click(page, "cancel")
        badge(page, "cancelled")
        timeline(page, "cancelled")
        assert widget(page).locator(".singularity-preempt").is_disabled()
        cell(page, 1).locator(".jp-OutputArea-output", has_text="was cancelled").wait_for()  # the cell ended
        shoot(page, shots, "jupyter-browser-controls.png")
    except Exception:
        shoot(page, shots, "jupyter-browser-controls-FAILED.png")
        print(cells_text(page))
        print(backend_logs(lab))
        raise
    finally:
        page.close()
        cancel_all(lab)


def test_preempt_resume_resize_a_running_cell_with_its_curve(lab, browser, shots):
    """Cell 1 trains undisturbed; cell 2 trains the same while its widget preempts, resumes and
    resizes it: the chart marks the preemption, and both cells end with the same value. (The
    embedded backend has 2 devices: the two runs take turns.)"""
    page = open_notebook(lab, browser, "resize", [f"%%singularity --gpus 2 --ranks 2 --name plain\n{DDP}",
                                                  f"%%singularity --gpus 2 --ranks 2 --name moved\n{SLOW_DDP}"])
    try:
        reference = result(page, 1)
        badge(page, "running", index=2)
        w = widget(page, 2)
        w.locator(".singularity-curve").wait_for(timeout=60_000)
        w.locator(".singularity-logs pre", has_text="step=40 ").wait_for(state="attached", timeout=60_000)
        click(page, "preempt", index=2)
        badge(page, "preempted", index=2)
        w.locator(".singularity-marker-preempted").wait_for()
        assert running(page, 2)
        doc = shoot(page, shots, "jupyter-widget-preempted.png", element=w)
        if not DOC_SHOT.exists() or os.environ.get("SINGULARITY_UPDATE_SCREENSHOTS") == "1":
            DOC_SHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(doc, DOC_SHOT)
        click(page, "resume", index=2)
        timeline(page, "resumed", index=2)
        badge(page, "running", index=2)
        # on a loaded machine the job may start shrunk on 1 device (the last test's cancelled
        # job still releasing one), and a resize to 1 would then change nothing: wait for both
        w.get_by_text(re.compile(r"^placement: .* on 2 device\(s\)")).wait_for(timeout=60_000)
        size = w.locator(".singularity-resize-to input")
        size.fill("1")
        size.press("Enter")
        assert running(page, 2)
        click(page, "resize", index=2)
        timeline(page, "resized", timeout=120_000, index=2)
        assert result(page, 2) == reference  # exact after a preemption and a resize
        shoot(page, shots, "jupyter-browser-resize.png")
    except Exception:
        shoot(page, shots, "jupyter-browser-resize-FAILED.png")
        print(cells_text(page))
        print(backend_logs(lab))
        raise
    finally:
        page.close()
        cancel_all(lab)
