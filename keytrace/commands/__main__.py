"""``python -m keytrace.commands`` runs the CLI (handy where the console script is not on PATH)."""

from keytrace.commands import entry

entry()
