"""The keytrace version, kept in one place (layer 0: imports nothing).

``pyproject.toml`` reads it at build time (``[tool.setuptools.dynamic]``), so the installed
distribution's metadata, ``keytrace --version``, every part's ``keytrace.version`` and
``report.md`` all say this one string.
"""

__version__ = "0.1.0"
