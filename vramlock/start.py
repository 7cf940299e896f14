"""The ``vramlock`` command's entry point (and ``python -m vramlock``'s).

``vramlock serve`` listens on its address first, before the command line is imported
(``net.prebind``); every command then goes to ``cli.main``.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy takes it as True
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    if sys.argv[1:2] == ["serve"]:
        from .net.prebind import early

        early(sys.argv[2:])
    from .cli import main as cli_main

    cli_main()
