#!/usr/bin/env python3
"""A readable report of stored plans: ``plancache inspect`` as a script.

    python scripts/inspect_plans.py                      # every plan in $PLANCACHE_DIR
    python scripts/inspect_plans.py 3fa2 9c01 --json     # some plans (key prefixes), as JSON
    python scripts/inspect_plans.py --dir /srv/plans --env 1a2b3c4d5e6f7a8b

Per plan: op summary, tensor shapes and dtypes, chosen engine, the candidates' timing
table, speed-up over the heuristics' first choice, hits and age.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from plancache.cli import main


def _argv(args: list[str]) -> list[str]:
    """Move the group options (--dir X, --debug) in front of the subcommand."""
    front, rest = [], []
    i = 0
    while i < len(args):
        if args[i] == "--dir" and i + 1 < len(args):
            front += args[i : i + 2]
            i += 2
            continue
        (front if args[i] == "--debug" or args[i].startswith("--dir=") else rest).append(args[i])
        i += 1
    return [*front, "inspect", *rest]


if __name__ == "__main__":
    main(_argv(sys.argv[1:]))
