"""stamp() and merge_patch(): the annotations the fencing webhook expects on a write."""

import copy
import os
import unittest

from fencedlease import (
    DELETE_INTENT_ANNOTATION,
    LEASE_UID_ANNOTATION,
    TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
    LeadershipLost,
    Token,
    delete_announcement,
    fencing_annotations,
    merge_patch,
    stamp,
)

T = Token(6, "0b6f-e1")


class Stamp(unittest.TestCase):
    def test_the_keys_are_the_webhooks(self):
        # The integration test (tests/client_python.rs) checks them against the Rust constants.
        self.assertEqual((TOKEN_ANNOTATION, LEASE_UID_ANNOTATION, WRITE_ID_ANNOTATION),
                         ("fencedlease.io/token", "fencedlease.io/lease-uid", "fencedlease.io/write-id"))

    def test_an_object_gets_the_three_annotations_and_keeps_its_own(self):
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "x", "annotations": {"mine": "1"}}, "data": {"k": "v"}}
        ann = stamp(cm, T)
        self.assertEqual(ann[TOKEN_ANNOTATION], "6")
        self.assertEqual(ann[LEASE_UID_ANNOTATION], "0b6f-e1")
        self.assertTrue(ann[WRITE_ID_ANNOTATION].startswith(f"6-{os.getpid()}-"))
        self.assertEqual(cm["metadata"]["annotations"], {"mine": "1", **ann})
        self.assertTrue(all(isinstance(v, str) for v in ann.values()))

    def test_every_write_gets_a_new_write_id(self):
        cm = {"metadata": {"name": "x"}}
        ids = {stamp(cm, T)[WRITE_ID_ANNOTATION] for _ in range(1000)}
        self.assertEqual(len(ids), 1000)
        self.assertNotEqual(fencing_annotations(T)[WRITE_ID_ANNOTATION], fencing_annotations(T)[WRITE_ID_ANNOTATION])

    def test_metadata_alone_or_missing_or_null(self):
        meta = {"name": "x"}
        stamp(meta, T)
        self.assertIn(TOKEN_ANNOTATION, meta["annotations"])
        obj = {"kind": "ConfigMap"}
        stamp(obj, T)
        self.assertIn(TOKEN_ANNOTATION, obj["metadata"]["annotations"])
        nulls = {"metadata": {"name": "x", "annotations": None}}
        stamp(nulls, T)
        self.assertEqual(set(nulls["metadata"]["annotations"]),
                         {TOKEN_ANNOTATION, LEASE_UID_ANNOTATION, WRITE_ID_ANNOTATION})

    def test_kubernetes_client_style_objects(self):
        class Meta:
            def __init__(self):
                self.name, self.annotations = "x", None

        class ConfigMap:
            def __init__(self):
                self.metadata = Meta()

        cm = ConfigMap()
        ann = stamp(cm, T)
        self.assertEqual(cm.metadata.annotations, ann)
        meta = Meta()
        stamp(meta, T)
        self.assertEqual(meta.annotations[TOKEN_ANNOTATION], "6")

    def test_what_cannot_be_stamped(self):
        for bad in [42, {"metadata": []}, {"metadata": {"annotations": "x"}}]:
            with self.subTest(obj=bad), self.assertRaises(TypeError):
                stamp(bad, T)
        with self.assertRaisesRegex(TypeError, "expected a fencedlease.Token"):
            stamp({}, 6)

    def test_a_lost_leadership_cannot_stamp(self):
        class Lost:
            def token(self):
                raise LeadershipLost("over")

        with self.assertRaises(LeadershipLost):
            stamp({}, Lost())


class MergePatch(unittest.TestCase):
    def test_adds_the_annotations_without_touching_the_input(self):
        patch = {"data": {"k": "v"}, "metadata": {"labels": {"a": "b"}}}
        before = copy.deepcopy(patch)
        body = merge_patch(T, patch)
        self.assertEqual(patch, before)
        self.assertEqual(body["data"], {"k": "v"})
        self.assertEqual(body["metadata"]["labels"], {"a": "b"})
        self.assertEqual(body["metadata"]["annotations"][TOKEN_ANNOTATION], "6")
        self.assertEqual(body["metadata"]["annotations"][LEASE_UID_ANNOTATION], "0b6f-e1")

    def test_annotation_deletions_in_the_patch_are_kept(self):
        body = merge_patch(T, {"metadata": {"annotations": {"old": None}}})
        self.assertIsNone(body["metadata"]["annotations"]["old"])
        self.assertIn(WRITE_ID_ANNOTATION, body["metadata"]["annotations"])

    def test_an_empty_patch_presents_the_token_alone(self):
        a, b = merge_patch(T), merge_patch(T)
        self.assertEqual(set(a), {"metadata"})
        self.assertNotEqual(a["metadata"]["annotations"][WRITE_ID_ANNOTATION],
                            b["metadata"]["annotations"][WRITE_ID_ANNOTATION])


class Tokens(unittest.TestCase):
    def test_tokens_are_checked(self):
        for gen, uid in [(0, "u"), (-1, "u"), (2**63, "u"), (True, "u"), ("6", "u"), (6, ""), (6, None)]:
            with self.subTest(gen=gen, uid=uid), self.assertRaises(ValueError):
                Token(gen, uid)


if __name__ == "__main__":
    unittest.main()


class DeleteAnnouncement(unittest.TestCase):
    def test_the_intent_is_the_announcing_write_s_own_id(self):
        a = delete_announcement(T)["metadata"]["annotations"]
        self.assertEqual(DELETE_INTENT_ANNOTATION, "fencedlease.io/delete-intent")
        self.assertEqual(a[TOKEN_ANNOTATION], "6")
        self.assertEqual(a[LEASE_UID_ANNOTATION], "0b6f-e1")
        self.assertEqual(a[DELETE_INTENT_ANNOTATION], a[WRITE_ID_ANNOTATION])
        b = delete_announcement(T)["metadata"]["annotations"]
        self.assertNotEqual(a[WRITE_ID_ANNOTATION], b[WRITE_ID_ANNOTATION])
