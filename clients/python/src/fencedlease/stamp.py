"""Stamping Kubernetes writes with the fencing token, as the fencing webhook expects.

A protected object is labelled ``fencedlease.io/lease: <lease>``; every create or update of it
must carry, in that very write, the holder's token, the lease's UID and a write id the object
has never carried before. The write id is what proves that the write presented the token
itself instead of leaving the stored one in place: the webhook refuses an update whose write id
is missing or unchanged.
"""

from __future__ import annotations

import copy
import os
import uuid
from typing import Any, Dict, Mapping, MutableMapping, Optional

from .model import Token

#: Label on a protected object naming the FencedLease (same namespace) that guards it.
LEASE_LABEL = "fencedlease.io/lease"
#: Annotation carrying the writer's fencing token (the lease's ``metadata.generation``).
TOKEN_ANNOTATION = "fencedlease.io/token"
#: Annotation carrying the UID of the lease the token belongs to.
LEASE_UID_ANNOTATION = "fencedlease.io/lease-uid"
#: Annotation carrying a value new on every write.
WRITE_ID_ANNOTATION = "fencedlease.io/write-id"
#: Annotation announcing a delete: set by a fenced update to its own write id, before the delete.
DELETE_INTENT_ANNOTATION = "fencedlease.io/delete-intent"


def _token_of(token: Any) -> Token:
    """A Token, or the current token of a Leadership (which raises LeadershipLost if over)."""
    if isinstance(token, Token):
        return token
    current = getattr(token, "token", None)
    if callable(current):
        t = current()
        if isinstance(t, Token):
            return t
    raise TypeError(
        f"expected a fencedlease.Token (from Client.token(), read_token_files() or a "
        f"leading() block), got {type(token).__name__}"
    )


def new_write_id(token: Any) -> str:
    """A write id never used before: the token, this process's id and a random UUID."""
    t = _token_of(token)
    return f"{t.generation}-{os.getpid()}-{uuid.uuid4().hex}"


def fencing_annotations(token: Any) -> Dict[str, str]:
    """The three annotations for one write, with a fresh write id on every call. ``token`` is a
    :class:`Token` or a ``leading()`` block's Leadership (checked right now)."""
    t = _token_of(token)
    return {
        TOKEN_ANNOTATION: str(t.generation),
        LEASE_UID_ANNOTATION: t.lease_uid,
        WRITE_ID_ANNOTATION: new_write_id(t),
    }


def stamp(obj_or_metadata: Any, token: Any) -> Dict[str, str]:
    """Sets the fencing annotations (token, lease UID, a fresh write id) on an object about to
    be written, in place, and returns them.

    ``obj_or_metadata`` is a Kubernetes object as a dict (with ``metadata``, ``kind`` or
    ``apiVersion``), its ``metadata`` dict, or an object of the ``kubernetes`` client library
    (``V1ConfigMap``, ``V1ObjectMeta``, ...). Other annotations are kept. Call it once per write:
    a write id must not be reused.
    """
    ann = fencing_annotations(token)
    meta = _metadata_of(obj_or_metadata)
    if isinstance(meta, MutableMapping):
        existing = meta.get("annotations")
        if existing is None:
            meta["annotations"] = existing = {}
        if not isinstance(existing, MutableMapping):
            raise TypeError(f"metadata.annotations is a {type(existing).__name__}, not a mapping")
        existing.update(ann)
    else:
        existing = getattr(meta, "annotations", None)
        if existing is None:
            existing = {}
            setattr(meta, "annotations", existing)
        existing.update(ann)
    return ann


def _metadata_of(obj: Any) -> Any:
    if isinstance(obj, MutableMapping):
        if "metadata" in obj or "kind" in obj or "apiVersion" in obj:
            meta = obj.get("metadata")
            if meta is None:
                obj["metadata"] = meta = {}
            if not isinstance(meta, MutableMapping):
                raise TypeError(f"metadata is a {type(meta).__name__}, not a mapping")
            return meta
        return obj  # the metadata itself
    if isinstance(obj, Mapping):
        raise TypeError("stamp() sets annotations in place: pass a mutable dict")
    if hasattr(obj, "metadata"):  # a kubernetes client model object
        meta = obj.metadata
        if meta is None:
            raise TypeError(f"{type(obj).__name__}.metadata is None: set metadata (with a name) first")
        return meta
    if hasattr(obj, "annotations"):  # V1ObjectMeta and the like
        return obj
    raise TypeError(f"cannot find the metadata of a {type(obj).__name__}: pass a dict or a kubernetes client object")


def merge_patch(token: Any, patch: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A JSON merge patch (``application/merge-patch+json``, or ``kubectl patch --type merge``)
    that applies ``patch`` and presents the token: a deep copy of ``patch`` with the fencing
    annotations (fresh write id) added to ``metadata.annotations``. ``patch`` is left as it was.
    """
    body: Dict[str, Any] = copy.deepcopy(dict(patch)) if patch is not None else {}
    meta = body.get("metadata")
    if meta is None:
        body["metadata"] = meta = {}
    if not isinstance(meta, dict):
        raise TypeError(f"patch metadata is a {type(meta).__name__}, not a dict")
    ann = meta.get("annotations")
    if ann is None:
        meta["annotations"] = ann = {}
    if not isinstance(ann, dict):
        raise TypeError(f"patch metadata.annotations is a {type(ann).__name__}, not a dict")
    ann.update(fencing_annotations(token))
    return body


def delete_announcement(token: Any) -> Dict[str, Any]:
    """The JSON merge patch that announces a delete of a protected object under ``token``.

    Deletes of protected objects are fenced: the holder sends this patch (``patch_namespaced_*``
    with it, or ``kubectl patch --type merge``), then the delete, both while it leads. The delete
    lands only while the object's last write is this announcement and its token is current::

        api.patch_namespaced_config_map("inventory", ns, delete_announcement(lead))
        api.delete_namespaced_config_map("inventory", ns)
    """
    body = merge_patch(token)
    ann = body["metadata"]["annotations"]
    ann[DELETE_INTENT_ANNOTATION] = ann[WRITE_ID_ANNOTATION]
    return body
