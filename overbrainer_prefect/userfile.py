"""A file the user names as an input (a questions file, an eval file), read as
text: what cannot be read is one line saying which file and what to give,
never the file's content."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def read_user_text(path: Path, what: str, give: str, error: Callable[[str], Exception]) -> str:
    """The UTF-8 text of the file `path` that the user gave as `what` (`eval
    file`, `questions file`). Raises `error` with one line when it does not
    exist or is not UTF-8 text (both saying to give `give`), or cannot be read
    (with the system's reason)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"the {what} {path} does not exist: give {give}") from None
    except UnicodeDecodeError:
        raise error(f"the {what} {path} is not UTF-8 text: give {give}") from None
    except OSError as failure:
        raise error(f"cannot read the {what} {path}: {failure.strerror}") from None
