"""The shared shell of the command-line entry points (train, evaluate, generate, dryrun)."""

from __future__ import annotations

import sys
from collections.abc import Callable


class RunFailed(RuntimeError):
    """A run that cannot go on (diverged training, non-finite outputs): one line, exit status 1."""


def run(main: Callable[[], object]) -> None:
    """Run `main`; a bad setting or a missing file (ValueError, FileNotFoundError, whose messages
    name the setting or path) becomes a one-line error and exit status 2 instead of a traceback,
    a RunFailed one line and exit status 1."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
