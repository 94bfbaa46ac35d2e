"""The shared evaluation data: where it lives (one environment variable, one lookup) and the Gutenberg stripper.

The folder holds real public data (PG-19 books, WikiText-2, the lm-eval task files, XSUM, the haystack essays) with a
``MANIFEST.md``. It is ``$H2O_KV_DATA`` when set, else a ``shared/data`` folder next to the checkout, i.e.
``./shared/data`` or ``../shared/data`` seen from the current directory.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

ENV = "H2O_KV_DATA"
_START = re.compile(r"\*\*\*\s*START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK.*?\*\*\*", re.IGNORECASE | re.DOTALL)
_END = re.compile(r"\*\*\*\s*END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK", re.IGNORECASE)


class MissingData(FileNotFoundError):
    """The shared data folder, or a file in it, is missing (the command line reports it in one line, exit status 2)."""


def data_dir() -> Path:
    """The shared data folder; raises :class:`MissingData` naming ``$H2O_KV_DATA`` when there is none."""
    if os.environ.get(ENV):
        folder = Path(os.environ[ENV]).expanduser()
        if not folder.is_dir():
            raise MissingData(f"${ENV} is {folder}, which is not a folder")
        return folder
    for candidate in (Path("shared/data"), Path("../shared/data")):
        if candidate.is_dir():
            return candidate.resolve()
    raise MissingData(
        f"no shared data folder: set ${ENV} to the folder holding MANIFEST.md (not found at ./shared/data or "
        "../shared/data)"
    )


def data_path(relative: str | Path) -> Path:
    """A file or folder inside the shared data folder; raises :class:`MissingData` naming it when it is missing."""
    path = data_dir() / relative
    if not path.exists():
        raise MissingData(f"{path} not found in the shared data folder (${ENV} or ./shared/data, ../shared/data)")
    return path


def has_data(relative: str | Path) -> bool:
    """Whether the shared data folder exists and holds ``relative`` (for tests and optional steps)."""
    try:
        data_path(relative)
    except FileNotFoundError:
        return False
    return True


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def strip_gutenberg(text: str) -> str:
    """The book between the ``*** START OF THE/THIS PROJECT GUTENBERG EBOOK ... ***`` and ``*** END OF ...``
    markers (header, footer and license removed), without leading/trailing line breaks.

    Strict: raises ``ValueError`` when either marker is missing, so a file that is not a Gutenberg release is never
    silently evaluated with its license text.
    """
    start = _START.search(text)
    if start is None:
        raise ValueError("no '*** START OF THE/THIS PROJECT GUTENBERG EBOOK ***' marker found")
    end = _END.search(text, start.end())
    if end is None:
        raise ValueError("no '*** END OF THE/THIS PROJECT GUTENBERG EBOOK' marker found")
    return text[start.end() : end.start()].strip("\r\n")
