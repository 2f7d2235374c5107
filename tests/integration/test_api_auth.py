"""The auth matrix: no token, wrong token, right token; with and without ``auth_read``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd

TOKEN = "s3cr3t-token"  # noqa: S105 - test data

#: (method, path, needs a token without auth_read, needs one with auth_read)
ENDPOINTS = [
    ("GET", "/healthz", False, False),
    ("GET", "/readyz", False, True),
    ("GET", "/metrics", False, True),
    ("GET", "/openapi.json", False, True),
    ("GET", "/api/v1/gpu/status", False, True),
    ("GET", "/api/v1/workers", False, True),
    ("GET", "/api/v1/workers/a-0", False, True),
    ("GET", "/api/v1/events", False, True),
    ("GET", "/api/v1/postmortems", False, True),
    ("GET", "/api/v1/targets", False, True),
    ("GET", "/api/v1/route?group=a", False, True),
    ("POST", "/api/v1/workers/a-0/restart", True, True),
    ("POST", "/api/v1/groups/a/restart", True, True),
    ("POST", "/api/v1/workers/nope/stop", True, True),  # 401 before 404: no name probing
    ("POST", "/api/v1/gpus/0/cordon", True, True),
    ("POST", "/api/v1/groups/a/rolling-restart", True, True),
    ("POST", "/api/v1/reload", True, True),
]

# (header sent, accepted when a token is needed)
CREDENTIALS = [
    (None, False),
    (f"Bearer {TOKEN}x", False),
    ("Bearer", False),
    (f"Basic {TOKEN}", False),
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),
]


@pytest.mark.parametrize("auth_read", [False, True])
def test_auth_matrix(supervisor: SupervisorFactory, tmp_path: Path, auth_read: bool) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "api": {"listen": "127.0.0.1:0", "token_file": str(token_file), "auth_read": auth_read},
            "workers": [{"name": "a", "command": worker_cmd("ready_then_sleep")}],
        }
    )
    sup.ready("a-0")
    with sup.api() as http:
        for method, path, needs_write, needs_read in ENDPOINTS:
            needed = needs_read if auth_read else needs_write
            for header, good in CREDENTIALS:
                headers = {"Authorization": header} if header is not None else {}
                answer = http.request(method, path, headers=headers)
                what = f"{method} {path} with {header!r}"
                if needed and not good:
                    assert answer.status_code == 401, what
                    assert answer.headers["www-authenticate"] == "Bearer", what
                    assert "bearer token" in answer.json()["error"], what
                else:
                    assert answer.status_code != 401, what
                    assert answer.status_code < 500, what
        # The OpenAPI document declares the bearer scheme on exactly the guarded operations.
        doc = http.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
        guarded = {
            (m.upper(), p)
            for p, ops in doc["paths"].items()
            for m, op in ops.items()
            if "security" in op
        }
        assert ("POST", "/api/v1/workers/{name}/drain") in guarded
        assert ("GET", "/healthz") not in guarded
        assert (("GET", "/api/v1/workers") in guarded) is auth_read
    assert sup.stop() == 0
