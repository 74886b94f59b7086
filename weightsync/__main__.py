"""``python -m weightsync``: the same command line as ``weightsync``."""

from __future__ import annotations

from .bench import main

# Spawned bench workers import this module again; only the real entry runs.
if __name__ == "__main__":
    raise SystemExit(main())
