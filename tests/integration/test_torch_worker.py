"""``examples/workers/torch_worker.py`` under the supervisor (PyTorch is optional: skipped
without it; on a machine without a GPU the worker runs on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from supervisor.plan import WORKER_SITE_DIR
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


PROBE = """
import json, sys
import torch
from supervisor.worker_site import sitecustomize as site  # its functions (started by site)
before = site.in_use_mb(sys.modules)  # torch imported, CUDA untouched by the program
after = None
if torch.cuda.is_available():
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    after = site.in_use_mb(sys.modules)
print(json.dumps({"before": before, "after": after, "init": torch.cuda.is_initialized(),
                  "threads": [t.name for t in __import__("threading").enumerate()]}))
"""


def test_the_in_use_reporter_with_real_torch(tmp_path: Path) -> None:
    """The reporter's reading with the real PyTorch: nothing while the program has not
    initialised CUDA (and it does not initialise it); on a GPU, what a tensor holds."""
    env = {
        **os.environ,
        "PYTHONPATH": WORKER_SITE_DIR,
        "GPU_SUPERVISOR_IN_USE_SOCKET": str(tmp_path / "nobody.sock"),
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["before"] is None
    assert "gpu-supervisor-in-use" in got["threads"]
    if got["after"] is None:  # no GPU here: CUDA must still be untouched
        assert got["init"] is False
    else:
        assert got["after"] >= 256
