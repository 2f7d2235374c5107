"""A real PyTorch inference worker for gpu-supervisor (optional: torch is not a dependency).

Loads a small model on the GPU the supervisor gave it (``CUDA_VISIBLE_DEVICES``), honours the
GPU memory budget ``GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB`` with
``torch.cuda.set_per_process_memory_fraction``, speaks sd_notify (``READY=1`` once the model
is loaded and warmed up, ``WATCHDOG=1`` from the serving loop, ``STATUS=``), reports the CUDA
memory its tensors hold with every heartbeat (``X_GPU_MEMORY_IN_USE_MB``, from
``torch.cuda.memory_allocated()``: the supervisor judges leaks on it instead of NVML's figure,
which counts the allocator's cache too), and serves on ``PORT``:

- ``POST /infer``  JSON ``{"batch": N}`` -> ``{"batch": N, "ms": ..., "device": ...}``
- ``GET /healthz``  200 while the model answers
- ``GET /metrics``  its own Prometheus metrics (requests, latency, CUDA memory)

``--leak-mb-per-min N`` keeps N MiB a minute of CUDA tensors alive forever (the leaking
variant the supervisor's leak detector should catch). Without a GPU it runs on the CPU.

    gpu-supervisor run -c examples/torch.toml      # needs: pip install torch prometheus_client
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
import time
from typing import Any

from sdnotify import notify

try:
    import torch
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        Counter,
        Gauge,
        Histogram,
        generate_latest,
    )
except ImportError as exc:  # pragma: no cover - documented as optional
    sys.exit(
        f"torch_worker.py needs PyTorch and prometheus_client ({exc}): "
        "pip install torch prometheus_client"
    )

MIB = 1024 * 1024
REQUESTS = Counter("worker_requests", "Inference requests.", ["status"])
LATENCY = Histogram("worker_request_seconds", "Inference latency (seconds).")
CUDA_ALLOCATED = Gauge("worker_cuda_allocated_bytes", "torch.cuda.memory_allocated().")
CUDA_RESERVED = Gauge("worker_cuda_reserved_bytes", "torch.cuda.memory_reserved().")


def device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def apply_budget(dev: torch.device) -> str:
    """Cap this process's CUDA caching allocator at the supervisor's budget."""
    limit = float(os.environ.get("GPU_SUPERVISOR_GPU_MEMORY_LIMIT_MB", "0") or 0)
    if dev.type != "cuda" or limit <= 0:
        return "no budget"
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(1.0, limit * MIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return f"budget {limit:g} MiB = {fraction:.3f} of {total / MIB:.0f} MiB"


class Model:
    """A small MLP; ``infer`` is serialised (one CUDA stream, no batching games)."""

    def __init__(self, dev: torch.device, width: int = 1024) -> None:
        self.dev = dev
        self.width = width
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
        ).to(dev)
        self.net.eval()
        self.lock = threading.Lock()
        self.leaked: list[torch.Tensor] = []

    def infer(self, batch: int) -> float:
        with self.lock, torch.inference_mode():
            start = time.perf_counter()
            x = torch.randn(batch, self.width, device=self.dev)
            self.net(x).sum().item()  # .item() synchronises
            return (time.perf_counter() - start) * 1000

    def leak(self, mib: float) -> None:
        with self.lock:
            self.leaked.append(torch.empty(int(mib * MIB), dtype=torch.uint8, device=self.dev))


def serve(model: Model, port: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._send(200, b'{"status": "ok"}')
            elif self.path == "/metrics":
                if model.dev.type == "cuda":
                    CUDA_ALLOCATED.set(torch.cuda.memory_allocated(model.dev))
                    CUDA_RESERVED.set(torch.cuda.memory_reserved(model.dev))
                self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            if self.path != "/infer":
                self._send(404, b'{"error": "not found"}')
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
                batch = max(1, min(int(body.get("batch", 8)), 512))
                with LATENCY.time():
                    ms = model.infer(batch)
            except (ValueError, TypeError) as exc:
                REQUESTS.labels("400").inc()
                self._send(400, json.dumps({"error": str(exc)}).encode())
                return
            except torch.cuda.OutOfMemoryError as exc:  # over the budget: say so, keep serving
                REQUESTS.labels("507").inc()
                self._send(507, json.dumps({"error": f"CUDA out of memory: {exc}"}).encode())
                return
            REQUESTS.labels("200").inc()
            reply = {"batch": batch, "ms": round(ms, 3), "device": str(model.dev)}
            self._send(200, json.dumps(reply).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="model width")
    parser.add_argument("--leak-mb-per-min", type=float, default=0.0, help="leak this much")
    args = parser.parse_args()
    dev = device()
    budget = apply_budget(dev)
    model = Model(dev, args.width)
    model.infer(8)  # warm-up: CUDA context, kernels, allocator
    port = int(os.environ.get("PORT", "8001"))
    serve(model, port)
    name = os.environ.get("GPU_SUPERVISOR_WORKER", "torch-worker")
    print(f"{name}: serving on 127.0.0.1:{port} ({dev}, {budget})", flush=True)
    notify(f"READY=1\nSTATUS=serving on {port} ({dev})")
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    beat = min(watchdog_usec / 2e6, 1.0) if watchdog_usec else 1.0
    last_leak = time.monotonic()
    while True:
        time.sleep(beat)
        model.infer(1)  # the heartbeat is honest: it proves the GPU still answers
        beat_msg = "WATCHDOG=1"
        if dev.type == "cuda":  # what the tensors hold, without the cache NVML also counts
            beat_msg += f"\nX_GPU_MEMORY_IN_USE_MB={torch.cuda.memory_allocated(dev) / MIB:.1f}"
        notify(beat_msg)
        if args.leak_mb_per_min > 0:
            now = time.monotonic()
            model.leak(args.leak_mb_per_min * (now - last_leak) / 60)
            last_leak = now


if __name__ == "__main__":
    main()
