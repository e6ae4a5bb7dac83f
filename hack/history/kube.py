"""A tiny Kubernetes API client for the history test (stdlib only).

Reads the kubeconfig that hack/cluster.sh writes (server, CA data, bearer token)."""
import base64
import json
import re
import ssl
import tempfile
import urllib.error
import urllib.request


class Kube:
    def __init__(self, kubeconfig, server=None):
        text = open(kubeconfig).read()
        self.server = server or re.search(r"server:\s*(\S+)", text).group(1)
        self.token = re.search(r"token:\s*(\S+)", text).group(1)
        ca = base64.b64decode(re.search(r"certificate-authority-data:\s*(\S+)", text).group(1))
        self.ctx = ssl.create_default_context(cadata=ca.decode())

    def request(self, method, path, body=None, timeout=5, content_type="application/json"):
        """Returns (status, parsed JSON or text). Network errors raise OSError."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", "Bearer " + self.token)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as r:
                raw = r.read()
                code = r.status
        except urllib.error.HTTPError as e:
            raw = e.read()
            code = e.code
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    def watch(self, path, timeout=30):
        """Yields watch events (dicts) until the stream ends or breaks."""
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(self.server + path + sep + "watch=1")
        req.add_header("Authorization", "Bearer " + self.token)
        with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)
