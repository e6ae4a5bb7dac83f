"""read_token_files: the files the sidecar keeps while leading."""

import os
import tempfile
import unittest
from unittest import mock

from fencedlease import Token, TokenFileError, default_token_dir, read_token_files


class TokenFiles(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def write(self, name, content):
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(content)

    def test_leading_as_the_sidecar_writes_them(self):
        self.write("lease-uid", b"0b6f-e1\n")
        self.write("token", b"6\n")
        self.assertEqual(read_token_files(self.dir), Token(6, "0b6f-e1"))

    def test_absent_means_not_leading(self):
        self.assertIsNone(read_token_files(self.dir))
        self.assertIsNone(read_token_files(os.path.join(self.dir, "no-such-dir")))

    def test_a_token_without_its_uid_means_leadership_just_ended(self):
        self.write("token", b"6\n")
        self.assertIsNone(read_token_files(self.dir))

    def test_malformed_tokens_are_errors_not_tokens(self):
        self.write("lease-uid", b"u\n")
        for bad in [b"07\n", b"-1\n", b"+7\n", b" 7\n", b"7 \n", b"\n", b"", b"seven\n", b"0\n",
                    b"9223372036854775808\n", b"6\n\n"]:
            with self.subTest(content=bad):
                self.write("token", bad)
                with self.assertRaisesRegex(TokenFileError, "does not hold a fencing token"):
                    read_token_files(self.dir)

    def test_a_bad_uid_is_an_error(self):
        self.write("token", b"6\n")
        for bad in [b"\n", b"a b\n"]:
            with self.subTest(content=bad):
                self.write("lease-uid", bad)
                with self.assertRaisesRegex(TokenFileError, "does not hold a lease UID"):
                    read_token_files(self.dir)

    def test_reads_are_bounded(self):
        self.write("lease-uid", b"u\n")
        self.write("token", b"1" * 10000)
        with self.assertRaisesRegex(TokenFileError, "larger than 256 bytes"):
            read_token_files(self.dir)

    def test_the_largest_token(self):
        self.write("lease-uid", b"u\n")
        self.write("token", b"9223372036854775807\n")
        self.assertEqual(read_token_files(self.dir), Token(2**63 - 1, "u"))

    def test_default_dir_follows_the_injected_env(self):
        with mock.patch.dict(os.environ, {"FENCEDLEASE_TOKEN_FILE": os.path.join(self.dir, "token")}):
            self.assertEqual(default_token_dir(), self.dir)
            self.write("lease-uid", b"u\n")
            self.write("token", b"3\n")
            self.assertEqual(read_token_files(), Token(3, "u"))
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertEqual(default_token_dir(), "/var/run/fencedlease")


if __name__ == "__main__":
    unittest.main()
