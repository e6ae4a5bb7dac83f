"""The token files the sidecar keeps in its token dir while this pod leads."""

from __future__ import annotations

import errno
import os
from typing import Optional, Union

from .errors import TokenFileError
from .model import Token, parse_token

#: Where the injected sidecar keeps them (``FENCEDLEASE_TOKEN_FILE`` is ``DIR/token``).
DEFAULT_TOKEN_DIR = "/var/run/fencedlease"
#: A token file is a number and a newline; a lease UID 36 characters. Reads stop here.
_MAX_FILE = 256


def default_token_dir() -> str:
    """The folder of ``$FENCEDLEASE_TOKEN_FILE``, else ``/var/run/fencedlease``."""
    f = os.environ.get("FENCEDLEASE_TOKEN_FILE")
    return os.path.dirname(f) if f else DEFAULT_TOKEN_DIR


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        raise TokenFileError(f"reading {path} failed: {e}; is the token dir shared with the sidecar and readable?") from e
    if len(data) > _MAX_FILE:
        raise TokenFileError(f"{path} is larger than {_MAX_FILE} bytes: it is not a token file the sidecar wrote")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise TokenFileError(f"{path} is not ASCII: it is not a token file the sidecar wrote") from None
    return text[:-1] if text.endswith("\n") else text


def read_token_files(dir: Union[str, "os.PathLike[str]", None] = None) -> Optional[Token]:
    """Reads ``token`` and ``lease-uid`` from the sidecar's token dir (default
    :func:`default_token_dir`). Returns the Token while they say this pod leads, None when they
    are absent (not leading, or the sidecar is between writes).

    The files are a hint, not the truth: the sidecar writes them atomically and removes them
    when leadership ends, and a restarted sidecar removes its predecessor's first thing, but
    between a sidecar crash and its restart a stale file stays. Writes must still carry the
    token to the fencing webhook, which refuses a stale one.
    """
    d = os.fspath(dir) if dir is not None else default_token_dir()
    token_path, uid_path = os.path.join(d, "token"), os.path.join(d, "lease-uid")
    # The sidecar writes lease-uid before token and removes token before lease-uid. Reading
    # token, lease-uid, token again and insisting the two token reads agree gives a pair
    # that was on disk together; retry a few times if a write raced us.
    for _ in range(5):
        first = _read(token_path)
        if first is None:
            return None
        uid = _read(uid_path)
        second = _read(token_path)
        if second != first:
            continue
        if uid is None:
            return None  # leadership ended between the reads
        try:
            generation = parse_token(first)
        except ValueError as e:
            raise TokenFileError(f"{token_path} does not hold a fencing token: {e}") from None
        if not uid or any(c.isspace() for c in uid):
            raise TokenFileError(f"{uid_path} does not hold a lease UID: {uid!r}")
        return Token(generation, uid)
    raise TokenFileError(f"the token files in {d} kept changing while being read; try again")
