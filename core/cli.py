"""One way for every command to fail: ``error:`` + ``hint:``, exit 2, tracebacks on request.

Every console script and subcommand builds its parser from :class:`Parser` and runs its body
through :func:`run_main`, so a usage mistake, a bad value and a failed pre-flight check all
print the same two lines and exit with :data:`~hpcai.core.errors.USAGE_EXIT`; ``-v`` or
``--verbose`` (before ``--``) adds the traceback.
"""

from __future__ import annotations

import argparse
import sys

from .errors import USAGE_EXIT, UserError

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

VERBOSE_FLAGS = ("-v", "--verbose")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are :class:`UserError` with a hint, and which
    takes ``-v``/``--verbose`` (read by :func:`run_main`)."""

    def __init__(self, *args, hint: str | None = None, verbose_flag: bool = True,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hint = hint
        if verbose_flag:   # off where the flag passes through to another parser
            self.add_argument(*VERBOSE_FLAGS, dest="verbose", action="store_true",
                              help="print the traceback of an error")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message, self.hint or f"see {self.prog} --help")

    def _get_formatter(self):
        # argparse asks shutil for the terminal width whenever an argument is added, and
        # importing shutil imports the compression modules: the same width, without them
        return self.formatter_class(prog=self.prog, width=_columns() - 2)


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` gives it: ``COLUMNS``, else the
    terminal of standard output, else 80."""
    import os

    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``[options] -- CMD ...`` -> (options, CMD or None when there is no ``--``)."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def wants_verbose(argv: list[str]) -> bool:
    """``-v``/``--verbose`` among the options (not in the command after ``--``)."""
    head, _ = split_command(argv)
    return any(a in VERBOSE_FLAGS for a in head)


def say_error(exc: UserError) -> None:
    print(exc.render(), file=sys.stderr, flush=True)


def run_main(body: Callable[[list[str]], int], argv: list[str] | None = None, *,
             report: Callable[[UserError], None] = say_error) -> int:
    """Run a command's body; a :class:`UserError` is reported once and becomes exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return body(args)
    except UserError as exc:
        if wants_verbose(args):
            import traceback    # here: it imports linecache, tokenize and textwrap
            traceback.print_exc()
        report(exc)
        return USAGE_EXIT
