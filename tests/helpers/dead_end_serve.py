"""`poot-serve` with one test double in it: a request constrained by the regex DEAD_END gets a matcher that stops
allowing any token after AFTER tokens (constraint_doubles.DeadEnd); every other request is served as usual.
Run as a script (helpers/server.py start_server(command=...)): the server test checks that such a failure ends
only its own request."""

from __future__ import annotations

import sys
from pathlib import Path

DEAD_END = r"[a-z]{1,30} [a-z]{1,30} (?:dead|end)"  # no other test sends it; no reply is shorter than 3 tokens
AFTER = 1


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for `helpers`
    from helpers.constraint_doubles import fail_after
    from poot_core.cli.serve import main as serve
    from poot_core.driver.constraints import Constraint
    from poot_core.driver.core import Driver

    real = Driver.constraint_matcher
    marked = Constraint.regex(DEAD_END)

    def constraint_matcher(self, request):  # noqa: ANN001, ANN202 - Driver's own signature
        matcher = real(self, request)
        return fail_after(matcher, AFTER, "empty") if request.constraint == marked else matcher

    Driver.constraint_matcher = constraint_matcher  # type: ignore[method-assign]
    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
