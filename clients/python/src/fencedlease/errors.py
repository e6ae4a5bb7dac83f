"""The errors this package raises. Each message says what went wrong and what to do next."""

from __future__ import annotations

from typing import Optional


class FencedLeaseError(Exception):
    """Base class of every error raised by this package."""


class SidecarUnavailable(FencedLeaseError):
    """The sidecar could not be reached, did not answer in time, or dropped the connection.

    Treat it as "not leading": nothing here can tell whether this pod still leads.
    """


class ProtocolError(FencedLeaseError):
    """The sidecar answered, but not as the fencedlease sidecar API does: bad JSON, a body over
    the size limit, an unexpected status code, or a malformed event stream. Usually the URL
    points at something other than the sidecar API (its proxy or probe port, say), or the
    client and sidecar versions disagree."""


class Unauthorized(FencedLeaseError):
    """The sidecar refused the request: it did not carry the pod's API secret. The sidecar's
    loopback is reachable by ``kubectl port-forward``, so it answers only callers that can read
    the pod's token volume: the client sends the contents of its ``secret_file``
    (``$FENCEDLEASE_API_SECRET_FILE`` in an injected pod, else
    ``/var/run/fencedlease/api-secret``)."""


class TokenFileError(FencedLeaseError):
    """A token file exists but its content is not a token (or not a lease UID)."""


class NotLeader(FencedLeaseError):
    """This pod does not lead the lease right now. `holder` names the current holder as far
    as the sidecar knows (None when the lease is free or not yet observed)."""

    def __init__(self, message: str, holder: Optional[str] = None):
        super().__init__(message)
        self.holder = holder


class LeadershipLost(FencedLeaseError):
    """The leadership a `leading()` block was entered with is over (or can no longer be
    confirmed). Stop working with its token: writes that carry it are refused by the fencing
    webhook from now on. Enter a new `leading()` block to wait for the next tenure."""

    def __init__(self, message: str, token: object = None):
        super().__init__(message)
        self.token = token
