"""Locations of stores, models and checkpoints: local paths or fsspec URLs, told apart once."""

from __future__ import annotations

from os import PathLike

from .errors import StoreError


def normalize_url(url: str | PathLike[str]) -> str:
    """A location as a string: no trailing slash; ``file://`` URLs become plain local paths."""
    text = str(url).rstrip("/") or "/"
    return text[len("file://") :] if text.startswith("file://") else text


def is_url(url: str | PathLike[str]) -> bool:
    """True for a remote fsspec URL (``s3://...``, ``memory://...``), False for a local path."""
    return "://" in normalize_url(url)


def local_path(path: str | PathLike[str], what: str = "models and checkpoints") -> str:
    """`path` as a local path; a URL is refused (`what` is written by renaming folders)."""
    text = normalize_url(path)
    if is_url(text):
        raise StoreError(
            f"{text}: {what} are written to local or mounted folders, not URLs; give a path"
        )
    return text
