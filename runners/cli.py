"""What every stage's command line does with failures: expected errors become one line on
stderr and exit code 2; Ctrl-C says that nothing was left half-written and exits with 130."""
from __future__ import annotations

import sys
from typing import Callable


def run_cli(action: Callable[[], object], expected: tuple[type[BaseException], ...], interrupted: str) -> int:
    try:
        action()
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    return 0
