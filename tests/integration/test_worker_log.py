"""A worker's log through the API (``GET /api/v1/workers/{name}/log``) and ``gpu-supervisor
logs [-n N] [-f]``, against a running supervisor with real workers: the tail, the errors, and
a follower that sees every line once while the log rotates under it. The reading itself (real
files, hypothesis): tests/unit/test_log_read.py."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from tests.conftest import SupervisorFactory
from tests.harness import client as cli_client
from tests.harness import run_cli as cli

COUNT = [sys.executable, "-c", "for i in range(1, 31): print('line-%d' % i, flush=True)\n"
         "import time; time.sleep(600)"]  # fmt: skip


def test_the_log_of_a_worker_through_the_api_and_the_logs_command(
    supervisor: SupervisorFactory,
) -> None:
    sup = supervisor(
        {
            "workers": [
                {"name": "w", "command": COUNT, "ready": "none", "log_passthrough": True},
            ]
        }
    )
    sup.wait_line("[w-0] ", contains="line-30")  # the log file is written before passthrough
    url = sup.api_url()
    whole = "".join(f"line-{i}\n" for i in range(1, 31))
    with sup.api() as api:
        answer = api.get("/api/v1/workers/w-0/log")
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "text/plain; charset=utf-8"
        assert answer.text.endswith(whole)
        assert answer.headers["X-Log-File"] and "X-Log-Lost" not in answer.headers
        assert int(answer.headers["X-Log-Offset"]) == len(answer.content)
        assert api.get("/api/v1/workers/w-0/log?limit=8").text == "line-30\n"
        # following on from the end: nothing new yet, same place
        file, offset = answer.headers["X-Log-File"], answer.headers["X-Log-Offset"]
        more = api.get(f"/api/v1/workers/w-0/log?file={file}&offset={offset}")
        assert more.content == b"" and more.headers["X-Log-Offset"] == offset
        # from the start (each run of the worker begins with a line of the supervisor's)
        start = (
            f"--- gpu-supervisor: started pid {sup.find(event='worker.spawned')[0]['pid']} ---\n"
        )
        first = api.get(f"/api/v1/workers/w-0/log?file=&limit={len(start) + 7}")
        assert first.text == start + "line-1\n"
        assert first.headers["X-Log-Offset"] == str(len(start) + 7)

        unknown = api.get("/api/v1/workers/nope/log")
        assert unknown.status_code == 404
        assert unknown.json() == {"error": "unknown worker 'nope'"}
        for bad in ("limit=0", "limit=2000000", "offset=-1", "limit=x"):
            assert api.get(f"/api/v1/workers/w-0/log?{bad}").status_code == 422, bad

    done = cli("logs", "w-0", "-n", "3", "--url", url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "line-28\nline-29\nline-30\n", "")
    done = cli("logs", "w-0", "--url", url)  # 20 lines by default
    assert done.stdout == "".join(f"line-{i}\n" for i in range(11, 31))
    assert cli("logs", "w-0", "-n", "0", "--url", url).stdout == ""
    done = cli("logs", "nope", "--url", url)
    assert done.returncode == 2 and "unknown worker 'nope'" in done.stderr
    done = cli("logs", "w-0", "-n", "-1", "--url", url)
    assert done.returncode == 2 and "expected a whole number >= 0 (got '-1')" in done.stderr
    assert sup.stop() == 0


def test_logs_follow_sees_every_line_once_while_the_log_rotates(
    supervisor: SupervisorFactory,
) -> None:
    # about 400 lines a second into files of 1000 bytes: a rotation every few hundred ms
    ticker = [
        sys.executable,
        "-c",
        "import time\nfor i in range(10**9):\n print('n %d' % i, flush=True); time.sleep(0.0025)",
    ]
    sup = supervisor(
        {
            # 20 backups: a follower held up for seconds (a loaded machine) loses nothing
            "supervisor": {"log_max_bytes": 1000, "log_backups": 20},
            "workers": [{"name": "t", "command": ticker, "ready": "none", "stop_timeout_s": 2}],
        }
    )
    sup.wait_event(event="worker.spawned", worker="t-0")
    follower = cli_client("logs", "t-0", "-n", "0", "-f", "--url", sup.api_url())
    assert follower.stdout is not None
    numbers: list[int] = []
    buf = ""
    skipped = False
    deadline = time.monotonic() + 30
    try:
        while len(numbers) < 1200:  # three seconds: about ten rotations
            left = deadline - time.monotonic()
            assert left > 0, f"{len(numbers)} lines in 30 s"
            if select.select([follower.stdout], [], [], left)[0]:
                piece = os.read(follower.stdout.fileno(), 65536).decode()
                assert piece, f"logs -f ended: {follower.stderr.read() if follower.stderr else ''}"
                buf += piece
                *lines, buf = buf.split("\n")
                if not numbers and lines and not skipped:
                    # -n 0: from where the log ends, which may be inside a line (the
                    # supervisor writes what each read of the pipe gives): as `tail -n 0 -f`
                    lines, skipped = lines[1:], True
                numbers += [int(line.split()[1]) for line in lines]
        rotated = list((sup.state_dir / "logs").glob("t-0.log.*"))
        assert len(rotated) >= 3, rotated  # it did rotate, and more than once
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        follower.send_signal(signal.SIGINT)
        assert follower.wait(10) == 128 + signal.SIGINT
        assert (
            follower.stderr is not None and "gone before it was read" not in follower.stderr.read()
        )
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.__exit__(None, None, None)  # waits, closes its pipes
    assert sup.stop() == 0


def test_logs_follow_ends_saying_so_when_a_reload_removes_the_worker(
    supervisor: SupervisorFactory,
) -> None:
    keep = {"name": "k", "command": COUNT, "ready": "none"}
    sup = supervisor({"workers": [{"name": "w", "command": COUNT, "ready": "none"}, keep]})
    sup.wait_event(event="worker.spawned", worker="w-0")
    follower = cli_client("logs", "w-0", "-n", "1", "-f", "--url", sup.api_url())
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline()  # following now
        sup.write_config({"workers": [keep]})
        sup.signal(signal.SIGHUP)
        sup.wait_event(event="supervisor.reload_done", timeout=30)
        _, err = follower.communicate(timeout=30)
        assert follower.returncode == 1
        assert err.strip() == "gpu-supervisor: w-0 is gone (a reload removed it)"
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.__exit__(None, None, None)
    assert sup.stop() == 0


#: A worker's output with what a terminal acts on: clear the screen, write the clipboard
#: (OSC 52), a C1 CSI (UTF-8), a carriage return that overwrites a line with a fake one, a
#: byte that is not UTF-8; and text that is shown as it is (UTF-8, a tab, CRLF).
EVIL = (
    b"ok \xc3\xa9\tline\r\n"
    b"evil \x1b[2J\x1b]52;c;cHduZWQ=\x07 \xc2\x9b31m 10%\rgpu-supervisor: all fine\n"
    b"bad \xff byte\n"
    b"end\n"
)


def test_logs_on_a_terminal_shows_control_characters_escaped(
    supervisor: SupervisorFactory,
) -> None:
    """Regression: ``logs`` wrote a worker's bytes to the operator's terminal as they were, so
    a worker could clear the screen, set the clipboard or the title, or overwrite a line with
    a fake one. On a terminal they are shown escaped now; piped, the bytes are the log's."""
    import pty
    import subprocess
    import tty

    evil = [
        sys.executable,
        "-c",
        f"import sys, time; sys.stdout.buffer.write({EVIL!r}); sys.stdout.flush(); time.sleep(600)",
    ]
    sup = supervisor(
        {"workers": [{"name": "w", "command": evil, "ready": "none", "log_passthrough": True}]}
    )
    sup.wait_line("[w-0] ", contains="end")
    url = sup.api_url()
    piped = subprocess.run(
        [sys.executable, "-m", "supervisor", "logs", "w-0", "-n", "4", "--url", url],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert (piped.returncode, piped.stdout) == (0, EVIL), piped.stderr

    master, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: the bytes as the command wrote them
    try:
        shown = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "logs", "w-0", "-n", "4", "--url", url],
            stdout=slave,
            stderr=subprocess.PIPE,
        )
        os.close(slave)
        slave = -1
        out = b""
        deadline = time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            assert left > 0, out
            if not select.select([master], [], [], left)[0]:
                continue
            try:
                piece = os.read(master, 65536)
            except OSError:  # EIO: the command ended, its terminal closed
                break
            if not piece:
                break
            out += piece
        assert shown.wait(10) == 0, shown.stderr
    finally:
        if slave != -1:
            os.close(slave)
        os.close(master)
        if shown.poll() is None:
            shown.kill()
        shown.__exit__(None, None, None)
    assert out.decode() == (
        "ok \u00e9\tline\r\n"
        "evil \\x1b[2J\\x1b]52;c;cHduZWQ=\\x07 \\x9b31m 10%\\x0dgpu-supervisor: all fine\n"
        "bad \\xff byte\n"
        "end\n"
    )
    assert sup.stop() == 0
