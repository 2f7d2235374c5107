"""Schemathesis against the running supervisor's ``/openapi.json`` (fixed seed, a few hundred
cases): no server errors, and every answer conforms to the schema it documents."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import SupervisorFactory
from tests.harness import worker_cmd

SEED = 20261203
#: 503 is documented where it is an answer (``/readyz``, ``/api/v1/route``, an unreadable
#: post-mortem); ``status_code_conformance`` still fails any 503 an operation does not document.
CONFIG = """\
[checks.not_a_server_error]
expected-statuses = ["2XX", "3XX", "4XX", "503"]
"""


def test_schemathesis_finds_no_server_error_or_schema_violation(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor(
        {
            "supervisor": {"sample_interval_s": 0.2},
            "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim")},
            "workers": [
                {
                    "name": "g",
                    "replicas": 2,
                    "command": worker_cmd("gpu_user", "100"),
                    "drain_timeout_s": 0.2,
                    "stop_timeout_s": 2,
                    "metrics_path": "/metrics",
                },
                {"name": "c", "gpus": "none", "command": worker_cmd("ready_then_sleep")},
            ],
        }
    )
    for w in ("g-0", "g-1", "c-0"):
        sup.ready(w)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("schemathesis")),
            "--no-color",
            "--config-file",
            str(config),
            "run",
            f"{sup.api_url()}/openapi.json",
            "--checks",
            "all",
            "--seed",
            str(SEED),
            "--generation-database",
            "none",
            "--max-examples",
            "6",
            "--workers",
            "1",
            "--request-timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    summary = out.stdout[out.stdout.find("SUMMARY") :]
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", summary)
    assert counts is not None and counts[1] == counts[2], summary
    assert 100 <= int(counts[1]) <= 800, summary
    assert f"Seed: {SEED}" in summary
    assert not sup.find(event="api.error")
    assert sup.stop() == 0
