"""Issue 24.1: the demo writes `rpc-observe report`'s page, and a real browser (Debian's headless
Chromium, driven by playwright, the network cut off) renders it without a console error, showing the
run's methods with the call counts of its span files.

RPC_OBSERVE_REPORT_SCREENSHOT=docs/img/report.png also writes the screenshot there (how the
README's picture is made)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cluster import clean_env

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root, headless Chromium needs --no-sandbox; without the background-networking switches it
# tries to reach Google's services, and refused connections pile up.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("report_demo")
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "rpc_observe", "demo", "--duration", "2", "--out", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=240, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _browse(page_file: Path, screenshot: Path) -> dict[str, Any]:
    """Load ``page_file`` in headless Chromium, every request but the file itself aborted; what the
    page rendered, its console errors and uncaught exceptions, and the requests it tried."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("no chromium (apt-get install -y chromium); this test needs a real browser")
    sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    tried: list[str] = []
    url = page_file.resolve().as_uri()

    def route(r: Any) -> None:
        if r.request.url == url:
            r.continue_()
        else:
            tried.append(r.request.url)
            r.abort()

    with sync_api.sync_playwright() as p:
        # Never `playwright install`: Debian's Chromium, and a fresh profile per launch.
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1100}, offline=True)
            page = context.new_page()
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.route("**/*", route)
            page.goto(url, wait_until="load")
            page.wait_for_timeout(300)  # a late error (a chart drawn on the next frame) is caught too
            rows = page.eval_on_selector_all(
                "#methods-table tbody tr",
                "rows => rows.map(r => [r.dataset.method, ...[...r.cells].map(c => c.textContent)])")
            text = page.inner_text("body")
            rendered = page.get_attribute("body", "data-rendered")
            charts = page.eval_on_selector_all("canvas", "cs => cs.length")
            page.screenshot(path=str(screenshot), full_page=False)
        finally:
            browser.close()
    return {"errors": errors, "tried": tried, "rows": rows, "text": text, "rendered": rendered, "charts": charts}


def _client_calls(spans_dir: Path) -> Counter:
    """Client spans per method, read straight from the span files."""
    calls: Counter = Counter()
    for path in spans_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for sp in ss["spans"]:
                        if sp["kind"] == 3:
                            attrs = {a["key"]: a["value"] for a in sp["attributes"]}
                            calls[attrs["rpc.method"]["stringValue"]] += 1
    return calls


def test_the_demo_report_renders_offline_with_the_runs_numbers(demo_run: tuple[Path, str], tmp_path: Path) -> None:
    out, stdout = demo_run
    page_file = out / "report.html"
    assert f"report (one HTML page, opens offline):  {page_file}" in stdout
    assert "\r" not in stdout  # not a terminal: no progress-bar frames
    shot = tmp_path / "report.png"
    seen = _browse(page_file, shot)
    assert seen["errors"] == [] and seen["tried"] == [] and seen["rendered"] == "1"
    expected = _client_calls(out / "spans")
    shown = {row[0]: row for row in seen["rows"]}
    assert {m: int(row[2].replace(",", "")) for m, row in shown.items()} == dict(expected)
    # save_checkpoint fails every time; the bytes a message come from the saved /metrics scrapes.
    assert shown["save_checkpoint"][3] == shown["save_checkpoint"][2]
    assert shown["ParameterServer.get_weights"][13] not in ("-", "")
    for section in ("Traffic between workers", "Workers over the run", "Slowest calls", "Clock offsets", "Files"):
        assert section in seen["text"]
    assert "trace id" in seen["text"] and seen["charts"] >= 4
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("RPC_OBSERVE_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, target)


def test_the_browser_check_sees_a_script_that_throws(demo_run: tuple[Path, str], tmp_path: Path) -> None:
    """The check above can fail: the same page with a script that throws."""
    out, _ = demo_run
    html = (out / "report.html").read_text()
    broken = tmp_path / "broken.html"
    broken.write_text(html.replace("</body>", "<script>throw new Error('boom');</script></body>"))
    seen = _browse(broken, tmp_path / "broken.png")
    assert any("boom" in e for e in seen["errors"])
