"""Why a worker's process ended, for its post-mortem (pure).

The lifecycle knows how the process ended (an exit code, a signal, a stop we asked for and why);
this refines that into the post-mortem ``reason`` vocabulary and the ``evidence`` behind it.
Exits the operator asked for (stop, restart, reload, shutdown) are not deaths: no post-mortem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.model import HEALING_REASONS, ExitReason, ExitStatus

#: Lines that show a CUDA out-of-memory failure (PyTorch, the CUDA runtime and driver APIs,
#: and the libraries that allocate on their own: cuBLAS, cuDNN, NCCL).
CUDA_OOM_PATTERNS: tuple[str, ...] = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "Cuda failure 'out of memory'",  # NCCL
    "Cuda failure 2 'out of memory'",  # NCCL 2.19 and later (with the error's number)
    # JAX / XLA (``XlaRuntimeError: RESOURCE_EXHAUSTED: ...``; older: ``Resource exhausted``)
    "RESOURCE_EXHAUSTED: Out of memory",
    "Resource exhausted: Out of memory",
    "RESOURCE_EXHAUSTED: Failed to allocate request for",
    "Resource exhausted: Failed to allocate request for",
    # TensorFlow (a bare ``ResourceExhaustedError`` is also a quota or a gRPC message limit);
    # 2.11 and later wrap an eager op's: ``{{function_node __wrapped__AddV2_device_/job:
    # localhost/replica:0/task:0/device:GPU:0}} failed to allocate memory [Op:AddV2]``
    "OOM when allocating tensor",
    "ResourceExhaustedError: failed to allocate memory",
    "}} failed to allocate memory",
    # PyTorch's driver API calls (C10_CUDA_DRIVER_CHECK: expandable segments' cuMemCreate)
    "CUDA driver error: out of memory",
    # ONNX Runtime's CUDA execution provider (cuda_call.cc: ``CUDA failure 2: out of memory ;
    # GPU=0 ; hostname=... ; expr=cudaMalloc(...)``)
    "CUDA failure 2: out of memory",
    # llama.cpp / ggml (``ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB
    # on device 0: cudaMalloc failed: out of memory``)
    "cudaMalloc failed: out of memory",
    # FasterTransformer (``[FT][ERROR] CUDA runtime error: out of memory``)
    "CUDA runtime error: out of memory",
    # TensorRT (``[TRT] [E] 1: [defaultAllocator.cpp::allocate::19] Error Code 1: Cuda
    # Runtime (out of memory)``)
    "Cuda Runtime (out of memory)",
    # CuPy's memory pool (``Out of memory allocating 1,024 bytes (allocated so far: ...)``)
    "cupy.cuda.memory.OutOfMemoryError",
)
#: Messages that name the failed call between their start and the error's text, as
#: TensorRT-LLM's (``[TensorRT-LLM][ERROR] CUDA runtime error in ::cudaMallocAsync(ptr, n,
#: mCudaStream->get()): out of memory (.../tllmBuffers.h:118)``): the start, then the text
#: within :data:`CUDA_OOM_PAIR_SPAN` characters after it.
CUDA_OOM_PAIRS: tuple[tuple[str, str], ...] = (("CUDA runtime error in ", ": out of memory"),)
CUDA_OOM_PAIR_SPAN = 500
#: A line that names a CPU device is the host's memory (TensorFlow's ``OOM when allocating
#: tensor ... on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu``), not the GPU's;
#: so is pinned host memory the CUDA driver could not allocate (TensorFlow's and XLA's
#: ``failed to alloc 4294967296 bytes on host: CUDA_ERROR_OUT_OF_MEMORY: out of memory``,
#: after which they go on without it).
CUDA_OOM_NOT: tuple[str, ...] = ("device:CPU:", " bytes on host: ")

#: The most of the matching line a post-mortem's evidence shows (``log_line``).
LOG_LINE_CHARS = 2000

#: A CUDA out-of-memory line is a death's reason only when it came at most this long before
#: it: a worker that caught one (a server that halves its batch, a warm-up probing the largest
#: batch) and went on serving did not die of it when it ends much later for another reason.
#: A process that fails on one ends within seconds (its traceback, its shutdown), or within
#: minutes where its other ranks wait out NCCL's watchdog (10 minutes by default) first.
CUDA_OOM_FRESH_S = 900.0

#: Lifecycle reasons that are a worker death (or a healing action) and get a post-mortem.
POSTMORTEM_EXITS = frozenset(
    {
        ExitReason.EXIT,
        ExitReason.SIGNAL,
        ExitReason.HANG,
        ExitReason.START_TIMEOUT,
        ExitReason.DRAIN,
        ExitReason.MAX_AGE,  # as a drain: only when it died otherwise or ran out of time
        *HEALING_REASONS,
    }
)

#: A SIGKILL is an out-of-memory kill when the kernel's (or the cgroup's) oom_kill count went up.
SIGKILL = 9
#: Exit codes that pass a child's SIGKILL on: a shell's (``sh -c "python serve.py"``, a launch
#: script without exec, ``exit $?``: 128 + 9) and a launcher's ``sys.exit(child.returncode)``
#: (-9, as 256 - 9).
SIGKILL_EXIT_CODES = frozenset({128 + SIGKILL, 256 - SIGKILL})


@dataclass(frozen=True, slots=True)
class Classified:
    """A post-mortem's reason and evidence."""

    reason: str
    evidence: Mapping[str, Any]


def may_be_oom_kill(status: ExitStatus | None) -> bool:
    """Whether this end can be the kernel's OOM killer's: a SIGKILL, or a wrapper's exit that
    passes its child's SIGKILL on (then the oom_kill count says whether it was)."""
    if status is None:
        return False
    return status.signal == SIGKILL or status.code in SIGKILL_EXIT_CODES


def cuda_oom_at(line: str) -> int:
    """Where ``line`` shows a CUDA out-of-memory failure (-1: it shows none)."""
    if any(x in line for x in CUDA_OOM_NOT):
        return -1
    found = [first_at(line, CUDA_OOM_PATTERNS)]
    for first, then in CUDA_OOM_PAIRS:
        i = line.find(first)
        if i >= 0 and line.find(then, i, i + len(first) + CUDA_OOM_PAIR_SPAN) >= 0:
            found.append(i)
    return min((i for i in found if i >= 0), default=-1)


def excerpt(line: str, patterns: Sequence[str], size: int = LOG_LINE_CHARS) -> str:
    """``size`` characters of ``line`` that show the first of ``patterns`` it contains: its
    start, or (a long line whose match is further in) from a little before the match."""
    return excerpt_at(line, max(first_at(line, patterns), 0), size)


def first_at(line: str, patterns: Sequence[str]) -> int:
    """Where the first of ``patterns`` that ``line`` contains starts (-1: none)."""
    return min((i for i in (line.find(p) for p in patterns) if i >= 0), default=-1)


def excerpt_at(line: str, at: int, size: int = LOG_LINE_CHARS) -> str:
    """``size`` characters of ``line`` that show what is at ``at``."""
    start = 0 if at <= size // 2 else at - size // 4
    return line[start : start + size]


def classify(
    reason: ExitReason,
    status: ExitStatus | None,
    log_tail: Sequence[str],
    *,
    failure: bool,
    detail: str = "",
    timing: Mapping[str, float] | None = None,
    silent_for_s: float | None = None,
    healing: Mapping[str, Any] | None = None,
    oom_kills: int = 0,
    oom_scope: str = "cgroup",
    drain_timed_out: bool = False,
    drain_signal: int | None = None,
    last_probe: str | None = None,
    watchdog_triggered: bool = False,
    liveness_failed: str | None = None,
) -> Classified | None:
    """The post-mortem reason and evidence, or None when this exit gets no post-mortem.

    ``healing``: the evidence of the healing action that stopped the worker (for a healing
    reason); ``oom_kills``: how many OOM kills the kernel counted while the process ran (in its
    cgroup, or on the whole host shortly before its death: ``oom_scope``).
    """
    if reason not in POSTMORTEM_EXITS:
        return None
    timing = timing or {}
    base: dict[str, Any] = {"detail": detail, "counted_as_failure": failure}
    if status is not None:
        base["exit_code"] = status.code
        base["signal"] = status.signal_name
        if status.core_dumped:  # where to look next: the core file (core_pattern)
            base["core_dumped"] = True
    if reason is ExitReason.MAX_AGE:
        # a scheduled recycle (``max_age_s``) is a drain the supervisor asked for: no death
        # unless the worker died otherwise while it drained. Out of time, it was stopped as
        # planned (without a drain_signal a drain is a wait out of routing, then the stop)
        if drain_timed_out:
            return None
        base.update(healing or {})
        base["while"] = "max_age"
        reason = ExitReason.DRAIN
    if reason is ExitReason.DRAIN and not drain_timed_out:
        # An operator's drain is no death (as a stop is not): the worker finished and exited,
        # or its drain signal's default action ended it. One that died otherwise while it
        # drained (a crash, an error exit) is judged as any death, and says when.
        if (
            status is None
            or status.code == 0
            or (drain_signal is not None and status.signal == drain_signal)
        ):
            return None
        reason = ExitReason.SIGNAL if status.signal is not None else ExitReason.EXIT
        base.setdefault("while", "drain")
    if reason in HEALING_REASONS:
        return Classified(reason.value, {**base, **(healing or {})})
    if reason in (ExitReason.EXIT, ExitReason.SIGNAL):
        for line in reversed(log_tail):  # the last line that shows one
            at = cuda_oom_at(line)
            if at >= 0:
                return Classified("cuda_oom", {**base, "log_line": excerpt_at(line, at)})
        if may_be_oom_kill(status) and oom_kills > 0:
            return Classified(
                "host_oom", {**base, "oom_kills": oom_kills, "oom_kills_scope": oom_scope}
            )
        return Classified(reason.value, base)
    if reason is ExitReason.HANG:
        if liveness_failed:  # its liveness URL failed (health.liveness_url): how (the
            # heartbeat figures say nothing of it)
            return Classified(
                "hang", {**base, "watchdog_trigger": False, "liveness_failed": liveness_failed}
            )
        return Classified(
            "hang",
            {
                **base,
                "watchdog_s": timing.get("watchdog_s"),
                "silent_for_s": None if silent_for_s is None else round(silent_for_s, 3),
                # the worker said it was hung itself (WATCHDOG=trigger), however recent its
                # last heartbeat
                "watchdog_trigger": watchdog_triggered,
            },
        )
    if reason is ExitReason.START_TIMEOUT:
        # with an HTTP readiness URL, what its last probe got: the clue to why it never was
        probe = {"last_probe": last_probe} if last_probe is not None else {}
        return Classified(
            "start_timeout", {**base, "start_timeout_s": timing.get("start_timeout_s"), **probe}
        )
    # a drain that did not end within drain_timeout_s: the worker was stopped by force
    return Classified("drain", {**base, "drain_timeout_s": timing.get("drain_timeout_s")})
