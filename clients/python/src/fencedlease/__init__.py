"""Python client of the fencedlease sidecar: fenced leader election for Kubernetes workloads.

::

    from fencedlease import Client, leading, merge_patch

    with leading(Client()) as lead:            # waits until this pod leads
        while not lead.lost.is_set():
            body = merge_patch(lead, {"data": {"step": "1"}})   # raises LeadershipLost when over
            ...                                 # send body as a merge patch of a protected object

See the package README for the whole API and what each part promises.
"""

from .client import DEFAULT_SECRET_FILE, DEFAULT_URL, Client, Watch
from .errors import (
    FencedLeaseError,
    LeadershipLost,
    NotLeader,
    ProtocolError,
    SidecarUnavailable,
    TokenFileError,
    Unauthorized,
)
from .leadership import Leadership, leading, while_leading
from .model import Disconnected, Status, Token, parse_token
from .sse import SSEEvent, SSEParser
from .stamp import (
    DELETE_INTENT_ANNOTATION,
    LEASE_LABEL,
    LEASE_UID_ANNOTATION,
    TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
    delete_announcement,
    fencing_annotations,
    merge_patch,
    new_write_id,
    stamp,
)
from .tokenfiles import DEFAULT_TOKEN_DIR, default_token_dir, read_token_files

__version__ = "0.2.0"

__all__ = [
    "Client",
    "DEFAULT_SECRET_FILE",
    "DEFAULT_TOKEN_DIR",
    "DELETE_INTENT_ANNOTATION",
    "DEFAULT_URL",
    "Disconnected",
    "FencedLeaseError",
    "LEASE_LABEL",
    "LEASE_UID_ANNOTATION",
    "Leadership",
    "LeadershipLost",
    "NotLeader",
    "ProtocolError",
    "SSEEvent",
    "SSEParser",
    "SidecarUnavailable",
    "Status",
    "TOKEN_ANNOTATION",
    "Token",
    "TokenFileError",
    "Unauthorized",
    "WRITE_ID_ANNOTATION",
    "Watch",
    "default_token_dir",
    "delete_announcement",
    "fencing_annotations",
    "leading",
    "merge_patch",
    "new_write_id",
    "parse_token",
    "read_token_files",
    "stamp",
    "while_leading",
]
