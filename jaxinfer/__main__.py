"""``python -m jaxinfer`` runs the CLI."""

import sys

from jaxinfer.cli import main

sys.exit(main())
