"""The upstream-ready Markdown report (`keytrace report`): a visible Jinja2 template
(``templates/report.md.j2``) filled with analysis results. Renders only; never computes."""

from __future__ import annotations

from typing import Any

import jinja2

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("keytrace.report", "templates"),
    autoescape=False,  # Markdown, not HTML
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
)


def render_report(**context: Any) -> str:
    """The report text from the template's variables (see ``report.md.j2``)."""
    return _ENV.get_template("report.md.j2").render(**context)
