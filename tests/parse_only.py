"""Parses commands' arguments without running them, for tests/test_docs.py.

``python tests/parse_only.py '[["examples/generate.py", "--tiny"], ["kivi-xpu", "serve", "--port", "8000"]]'``
prints, as its last line, the JSON list of the commands whose arguments did not parse, each with the last line it
printed. torch, transformers and kivi_xpu are imported once; each command runs in a fork of this process:

* a script (``examples/...``, ``benchmarks/...``) runs with argparse's ``parse_args`` replaced by one that exits 0
  once it has parsed (argparse exits 2 on a bad argument), so nothing after the parse runs;
* ``kivi-xpu serve`` runs with ``--help`` added: its KIVI options are parsed by argparse and transformers' by click,
  which refuses an unknown option before it prints the help;
* another ``kivi-xpu`` command, as a script: ``kivi_xpu.__main__`` parses it with argparse.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (imported once, before the forks)
import transformers  # noqa: F401

import kivi_xpu.__main__


def _parse_only(self, *args, **kwargs):
    _parse(self, *args, **kwargs)
    raise SystemExit(0)


_parse = argparse.ArgumentParser.parse_args


def _run(argv: list[str]) -> int:
    """In the child: parses ``argv``; its exit code."""
    argparse.ArgumentParser.parse_args = _parse_only
    try:
        if argv[:2] == ["kivi-xpu", "serve"]:
            return kivi_xpu.__main__.main([*argv[1:], "--help"])
        if argv[0] == "kivi-xpu":
            kivi_xpu.__main__.main(argv[1:])
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        print(f"{argv[0]} never parsed its arguments", file=sys.stderr)
        return 1
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1


def _parse_in_a_fork(argv: list[str]) -> str | None:
    """None when ``argv`` parses, else the last line its parse printed."""
    with tempfile.TemporaryFile("w+") as log:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                code = _run(argv)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            return None
        log.seek(0)
        lines = [line for line in log.read().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {os.waitstatus_to_exitcode(status)}"


def main() -> None:
    commands = json.loads(sys.argv[1])
    failed = []
    for argv in commands:
        error = _parse_in_a_fork(argv)
        if error is not None:
            failed.append(f"{' '.join(argv)}: {error}")
    print(json.dumps(failed))


if __name__ == "__main__":
    main()
