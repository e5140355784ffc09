"""``python -m keytrace`` runs the CLI."""

from keytrace.cli import entry

entry()
