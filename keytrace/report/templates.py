"""The report layer's Jinja2 templates (``keytrace/report/templates/``), rendered in one
place: HTML pages autoescaped, text (Markdown, Python) verbatim with block tags on lines of
their own. Undefined names are errors, so a template cannot silently drop a value."""

from __future__ import annotations

from typing import Any

import jinja2

_LOADER = jinja2.PackageLoader("keytrace.report", "templates")
_HTML = jinja2.Environment(
    loader=_LOADER,
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)
_TEXT = jinja2.Environment(
    loader=_LOADER,
    autoescape=False,
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def render(name: str, **context: Any) -> str:
    """Template ``name`` (``*.html.j2`` autoescaped) filled with ``context``."""
    env = _HTML if name.endswith(".html.j2") else _TEXT
    return env.get_template(name).render(**context)
