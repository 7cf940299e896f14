"""What the tests share: starting and reaping processes, waiting with deadlines, witnesses,
loopback ports, ``vramlock`` command lines, and the fake engines and drivers. The fixtures
built on them are in tests/conftest.py; the programs the tests run are beside it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
