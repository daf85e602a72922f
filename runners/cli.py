"""What every stage's command line does with failures: expected errors become one line on
stderr and exit code 2, and so does a full disk; Ctrl-C says that nothing was left half-written
and exits with 130."""
from __future__ import annotations

import errno
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
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Every stage writes through runners.manifest.atomic_folder: the partial output is gone.
        print(f"error: no space left on the disk{f' writing {e.filename}' if e.filename else ''}: {interrupted}; "
              "free some space and run the command again", file=sys.stderr)
        return 2
    return 0
