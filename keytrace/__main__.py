"""``python -m keytrace`` runs the CLI."""

from keytrace.commands import entry

entry()
