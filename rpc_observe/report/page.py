"""The report as one HTML file: the data as inline JSON, the page's script and style, and the
charting library (uPlot, MIT, vendored in ``static/`` with its licence) inline, so the file opens
offline and fetches nothing."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parent / "static"
UPLOT_VERSION = "1.6.32"
# Nothing but what is inline: the page cannot fetch anything, even if a script tried.
_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _inline_json(data: Any) -> str:
    """JSON that cannot end its <script> element early: '<' is escaped as JSON allows."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render(data: dict[str, Any]) -> str:
    title = f"rpc_observe report: {data.get('run_id') or 'run'}"
    # The library's licence asks for its notice to go with every copy: it goes into the page too.
    notice = _static("uPlot.LICENSE").replace("*/", "* /")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_POLICY}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{_static("uPlot.min.css")}</style>
<style>{_static("report.css")}</style>
</head>
<body>
<header><h1>{html.escape(title)}</h1><p id="overview"></p></header>
<main id="report"><noscript>This report draws its tables and charts with JavaScript.</noscript></main>
<script type="application/json" id="report-data">{_inline_json(data)}</script>
<script>/* uPlot {UPLOT_VERSION}, https://github.com/leeoniya/uPlot
{notice}*/
{_static("uPlot.iife.min.js")}</script>
<script>{_static("report.js")}</script>
</body>
</html>
"""
