"""`KEY=VALUE` env files whose values reach jobs as secrets."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def read_env_file(path: Path) -> dict[str, SecretStr]:
    """The variables of the env file `path`: `KEY=VALUE` lines, `#` comments and
    blank lines ignored, optional `export ` prefix, values optionally quoted.

    Raises ValueError with one line (naming the line number, never the value)
    when the file cannot be read or a line is not `KEY=VALUE`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(
            f"cannot read the env file {path}: {error.strerror}; fix the target's env_file"
        ) from None
    values: dict[str, SecretStr] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise ValueError(f"{path} line {number} is not KEY=VALUE: fix or remove it")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = SecretStr(value)
    return values
