"""User-facing errors: a message and a hint, printed without a traceback."""

from __future__ import annotations

USAGE_EXIT = 2


class UserError(Exception):
    """A mistake the user can fix; the CLI prints `error:` and `hint:` and exits 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        lines = [f"error: {self.message}"]
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)
