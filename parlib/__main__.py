"""``python -m parlib COMMAND``: doctor, build, grade."""

from __future__ import annotations

import sys

USAGE = """usage: python -m parlib COMMAND [ARGS]

commands:
  doctor                 what this machine offers and what parlib.launch will do
  build [--check]        write solutions/ and exercises/ from authoring/ (--check: fail on drift)
  grade NB [NB ...]      run notebooks headless and print each question's score (--json FILE,
                         --no-sandbox, --timeout/--question-timeout/--notebook-timeout S)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from parlib.runtime.doctor import main as run
    elif command == "build":
        from parlib.course.nbbuild import main as run
    elif command == "grade":
        from parlib.course.grading import main as run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
