"""``examples/workers/torch_worker.py`` under the supervisor (PyTorch is optional: skipped
without it; on a machine without a GPU the worker runs on the CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import SupervisorFactory

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="PyTorch is not installed (optional for the example worker: pip install torch)",
)


def test_torch_worker_serves_and_reports_ready(supervisor: SupervisorFactory) -> None:
    sup = supervisor(
        {
            "gpu": {"backend": "none"},
            "workers": [
                {
                    "name": "mlp",
                    "command": [
                        sys.executable,
                        str(ROOT / "examples/workers/torch_worker.py"),
                        "--width",
                        "128",
                    ],
                    "port_base": 18601,
                    "metrics_path": "/metrics",
                    "start_timeout_s": 120,
                    "health": {"watchdog_s": 10, "gpu_memory_limit_mb": 1024},
                }
            ],
        }
    )
    sup.ready("mlp-0", timeout=120)
    answer = httpx.post("http://127.0.0.1:18601/infer", json={"batch": 4}, timeout=30).json()
    assert answer["batch"] == 4 and answer["device"] in ("cpu", "cuda:0")
    scrape = httpx.get("http://127.0.0.1:18601/metrics", timeout=10).text
    assert 'worker_requests_total{status="200"} 1.0' in scrape
    with sup.api() as api:
        targets = api.get("/api/v1/targets").json()
    assert targets == [
        {"targets": ["127.0.0.1:18601"], "labels": {"worker": "mlp-0", "group": "mlp"}}
    ]
    assert sup.stop() == 0
