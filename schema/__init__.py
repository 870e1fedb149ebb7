"""Checks of what we deploy; see schema/check.py."""

import sys
from pathlib import Path

# The Serve config's application args are checked with the forwarder's own model.
_SERVE = str(Path(__file__).resolve().parent.parent / "serve")
if _SERVE not in sys.path:
    sys.path.append(_SERVE)
