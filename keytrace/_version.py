"""The keytrace version, kept in one place (layer 0: imports nothing)."""

__version__ = "0.1.0"
