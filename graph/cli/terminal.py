"""Terminal output shared by the CLI modules: messages go to stderr, errors unwrapped."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)


def error(message: str) -> None:
    """Errors are printed unwrapped, so they can be grepped and copied whole."""
    console.print(message, style="red", soft_wrap=True, markup=False, highlight=False)
