"""``python -m keytrace.cli`` runs the CLI (handy where the console script is not on PATH)."""

from keytrace.cli import entry

entry()
