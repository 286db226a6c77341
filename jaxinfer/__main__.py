"""``python -m jaxinfer`` runs the CLI."""

from jaxinfer.cli import entry

entry()
