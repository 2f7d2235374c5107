"""The status page at ``GET /``: its headers over plain HTTP, and the page in headless Chromium.

The browser cases drive Debian's ``chromium`` with ``chromedriver`` through Selenium. Without
them (or without selenium) they skip, unless ``GPU_SUPERVISOR_REQUIRE_TOOLS=1`` (then they fail).
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from supervisor.backends.sim import SimBackend, write_atomic
from tests.conftest import SupervisorFactory
from tests.harness import Supervisor, worker_cmd
from tests.tools import REQUIRE_ENV, require_tool, tools_required

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

TOKEN = "st4tus-page-token"  # noqa: S105 - test data
WORKERS = ("g-0", "g-1", "c-0")
#: The page polls every 2 s; a change shows within one or two polls.
PAGE_WAIT_S = 20.0
#: APIs that would parse text as HTML: the page must set all text with textContent.
HTML_SINKS = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(")


def page_config(tmp_path: Path, **api: Any) -> dict[str, Any]:
    return {
        "supervisor": {"sample_interval_s": 0.2},
        "gpu": {"backend": "sim", "sim_dir": str(tmp_path / "sim")},
        "api": {"listen": "127.0.0.1:0", **api},
        "workers": [
            {
                "name": "g",
                "replicas": 2,
                "command": worker_cmd("gpu_user", "300"),
                "stop_timeout_s": 2,
            },
            {
                "name": "c",
                "gpus": "none",
                "command": worker_cmd("ready_then_sleep"),
                "stop_timeout_s": 2,
            },
        ],
    }


def token_api(tmp_path: Path) -> dict[str, Any]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return {"token_file": str(token_file), "auth_read": True}


def start(supervisor: SupervisorFactory, config: dict[str, Any]) -> Supervisor:
    sup = supervisor(config)
    for name in WORKERS:
        sup.ready(name)
    return sup


class _Inline(HTMLParser):
    """The text of every inline ``<script>`` and ``<style>`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[str, list[str]] = {"script": [], "style": []}
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.blocks:
            assert not attrs, f"<{tag}> with attributes {attrs}"
            self._in = tag
            self.blocks[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self.blocks[self._in][-1] += data

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {k for k, _ in attrs}
        assert "style" not in names, f"<{tag}> has a style attribute (the CSP blocks it)"
        assert not any(n.startswith("on") for n in names), f"<{tag}> has an inline handler"


def sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def csp_of(header: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in header.split(";"):
        words = part.split()
        if words:
            out[words[0]] = words[1:]
    return out


# --- plain HTTP -----------------------------------------------------------------------------


def test_page_is_served_with_a_strict_csp_and_stays_out_of_the_schema(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    sup = supervisor({**page_config(tmp_path), "workers": []})
    with sup.api() as http:
        answer = http.get("/")
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/html; charset=utf-8"
        assert answer.headers["cache-control"] == "no-cache"
        assert answer.headers["x-content-type-options"] == "nosniff"
        page = answer.text
        assert page.startswith("<!DOCTYPE html>")

        parser = _Inline()
        parser.feed(page)
        scripts, styles = parser.blocks["script"], parser.blocks["style"]
        assert len(scripts) == 1 and len(styles) == 1
        csp = csp_of(answer.headers["content-security-policy"])
        assert csp["default-src"] == ["'none'"]
        assert csp["script-src"] == [sha256_source(scripts[0])]
        assert csp["style-src"] == [sha256_source(styles[0])]
        assert csp["connect-src"] == ["'self'"]
        assert csp["frame-ancestors"] == ["'none'"]
        assert "unsafe-inline" not in answer.headers["content-security-policy"]
        for sink in HTML_SINKS:
            assert sink not in scripts[0], f"the page uses {sink}"
        # Only its own origin: no CDN, no external URL anywhere.
        assert not re.search(r"(src|href)=\"(https?:)?//", page)
        for path in ("healthz", "api/v1/gpu/status", "api/v1/workers", "api/v1/events?since="):
            assert f'"{path}' in scripts[0], path

        assert "/" not in http.get("/openapi.json").json()["paths"]
        assert http.post("/").status_code == 405
    assert sup.stop() == 0


def test_page_needs_the_token_when_reads_do(supervisor: SupervisorFactory, tmp_path: Path) -> None:
    sup = supervisor({**page_config(tmp_path, **token_api(tmp_path)), "workers": []})
    with sup.api() as http:
        # An API client gets the JSON 401 of every guarded read.
        answer = http.get("/")
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.json() == {"error": "missing bearer token (Authorization: Bearer <token>)"}
        assert http.get("/", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
        # Never in the query string.
        assert http.get("/", params={"token": TOKEN}).status_code == 401
        # A browser gets 401 too, with the page (no data in it) that asks for the token.
        html = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
        answer = http.get("/", headers=html)
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.headers["content-type"] == "text/html; charset=utf-8"
        assert "script-src 'sha256-" in answer.headers["content-security-policy"]
        ok = http.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        assert ok.content == answer.content
        assert http.get("/api/v1/workers").status_code == 401
    assert sup.stop() == 0


def test_page_is_public_when_only_writes_need_the_token(
    supervisor: SupervisorFactory, tmp_path: Path
) -> None:
    api = {**token_api(tmp_path), "auth_read": False}
    sup = supervisor({**page_config(tmp_path, **api), "workers": []})
    with sup.api() as http:
        assert http.get("/").status_code == 200
        assert http.get("/api/v1/workers").status_code == 200
    assert sup.stop() == 0


# --- in a browser ---------------------------------------------------------------------------


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chrome]:
    """Headless Chromium driven by ``/usr/bin/chromedriver`` (quit afterwards)."""
    chromium = require_tool("chromium", "apt-get install chromium")
    chromedriver = require_tool("chromedriver", "apt-get install chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        why = "selenium is not installed (pip install selenium)"
        if tools_required():
            pytest.fail(f"{why} and {REQUIRE_ENV}=1 requires it")
        pytest.skip(f"{why}; set {REQUIRE_ENV}=1 to make this a failure")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(chromedriver, log_output=subprocess.DEVNULL)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Chrome, what: str, check: Callable[[], Any]) -> Any:
    """Wait (up to PAGE_WAIT_S) until ``check()`` is truthy; fail with what the page shows."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.wait import WebDriverWait

    try:
        return WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.1).until(lambda _: check())
    except TimeoutException:
        shown = driver.execute_script("return document.body.innerText")
        pytest.fail(f"timed out waiting for {what}; the page shows:\n{shown}")


def rows(driver: Chrome) -> dict[str, dict[str, Any]]:
    """Every worker row as the page renders it: its cells' text and its sparkline."""
    found: dict[str, dict[str, Any]] = driver.execute_script(
        """
        const out = {};
        for (const tr of document.querySelectorAll('#workers tbody tr[data-worker]')) {
          const cells = Array.from(tr.cells, c => c.textContent.trim());
          const spark = tr.querySelector('svg.spark');
          out[tr.dataset.worker] = {
            cells, state: tr.dataset.state, chip: tr.querySelector('.state').textContent,
            samples: spark ? Number(spark.dataset.samples) : 0,
            path: !!(spark && spark.querySelector('path')),
          };
        }
        return out;
        """
    )
    return found


def gpu_rows(driver: Chrome) -> list[list[str]]:
    cells: list[list[str]] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#gpus tbody tr[data-gpu]'),"
        " tr => Array.from(tr.cells, c => c.textContent.trim()))"
    )
    return cells


def event_types(driver: Chrome) -> list[tuple[str, str]]:
    found: list[list[str]] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#events tbody tr[data-type]'),"
        " tr => [tr.dataset.type, tr.cells[3].textContent])"
    )
    return [(t, w) for t, w in found]


def status_of(driver: Chrome) -> str:
    return str(driver.execute_script("return document.body.dataset.status"))


def log_text(driver: Chrome) -> str:
    """The worker output the page shows."""
    text: str = driver.execute_script("return document.getElementById('log-text').textContent")
    return text


def open_output(driver: Chrome, worker: str) -> None:
    """Click ``worker``'s name (once the page lists it): its output opens."""
    wait_for(
        driver,
        f"{worker}'s name as a button",
        lambda: driver.execute_script(
            f"const b = document.querySelector('button[data-log=\"{worker}\"]');"
            " if (b) { b.click(); } return !!b"
        ),
    )


def assert_no_console_errors(driver: Chrome) -> None:
    """Nothing the CSP blocked, no script error."""
    logs = driver.get_log("browser")  # type: ignore[no-untyped-call]
    bad = [e for e in logs if e["level"] == "SEVERE" or "Content Security Policy" in e["message"]]
    # The 401 of a page opened without a token is logged as a failed resource, and is expected.
    bad = [e for e in bad if "401" not in e["message"]]
    assert not bad, bad


@pytest.mark.timeout(120)
def test_page_shows_workers_gpus_and_follows_a_state_change(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    sup = start(supervisor, page_config(tmp_path))
    browser.get(sup.api_url() + "/")
    assert browser.title == "gpu-supervisor"

    def all_ready() -> bool:
        shown = rows(browser)
        return set(shown) == set(WORKERS) and all(
            r["state"] == "ready" and r["chip"] == "ready" for r in shown.values()
        )

    wait_for(browser, "every worker ready", all_ready)
    assert status_of(browser) == "ok"
    gpus = wait_for(
        browser, "both simulated GPUs", lambda: len(gpu_rows(browser)) == 2 and gpu_rows(browser)
    )
    for index, cells in enumerate(gpus):
        assert cells[0] == str(index) and cells[1] == "Simulated GPU"
        assert "/ 80.0 GiB" in cells[3]
        assert "healthy" in cells[7]
    # GPU 1's row remap waits for a reset and the driver asks for P2P to be drained (alerts:
    # nothing moves): both are flagged
    gpu1 = tmp_path / "sim" / "gpus" / "1"
    write_atomic(gpu1, gpu1.read_text() + "remapped_rows_pending 1\nrecovery_action 3\n")
    wait_for(
        browser,
        "GPU 1's reset pending and recovery action",
        lambda: (
            "reset pending" in gpu_rows(browser)[1][7]
            and "needs drain p2p" in gpu_rows(browser)[1][7]
        ),
    )
    # The GPU workers' memory (300 MiB each) and a sparkline of at least two polled samples.
    wait_for(
        browser,
        "GPU memory and sparklines",
        lambda: all(
            r["cells"][5] == "300 MiB" and r["samples"] >= 2 and r["path"]
            for n, r in rows(browser).items()
            if n.startswith("g-")
        ),
    )
    shown = rows(browser)
    with sup.api() as http:
        for name in WORKERS:
            obj = http.get(f"/api/v1/workers/{name}").json()
            cells = shown[name]["cells"]
            assert cells[:4] == [name, obj["group"], "ready", str(obj["pid"])]
            assert cells[8] == str(obj["restarts"])
        assert shown["c-0"]["cells"][4] == "none"
        assert shown["c-0"]["cells"][5] == "\u2014"  # no GPU memory: a dash, not 0

        assert http.post("/api/v1/workers/c-0/stop").status_code == 202
        sup.wait_event(event="worker.state", worker="c-0", new="stopped")
        reason = http.get("/api/v1/workers/c-0").json()["last_exit"]["reason"]

    def stopped() -> bool:
        r = rows(browser).get("c-0")
        return r is not None and r["state"] == "stopped" and r["chip"] == "stopped"

    wait_for(browser, "c-0 stopped", stopped)
    cells = rows(browser)["c-0"]["cells"]
    assert cells[3] == "\u2014"  # no pid
    assert cells[9].startswith(reason)
    assert rows(browser)["g-0"]["state"] == "ready"
    wait_for(
        browser,
        "the stop in the events",
        lambda: (
            {("operator.stop", "\u2014"), ("worker.exited", "c-0")} <= set(event_types(browser))
        ),
    )
    assert_no_console_errors(browser)
    assert sup.stop() == 0


def gpu_chips(driver: Chrome) -> list[list[tuple[str, str, str | None]]]:
    """Each GPU row's flags: text, class and title of each chip."""
    found: list[list[list[Any]]] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#gpus tbody tr[data-gpu]'),"
        " tr => Array.from(tr.querySelectorAll('.chip'),"
        " c => [c.textContent, c.className, c.getAttribute('title')]))"
    )
    return [[(text, cls, title) for text, cls, title in row] for row in found]


@pytest.mark.timeout(120)
def test_page_flags_a_gpu_whose_xids_are_not_watched(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome, fake_nvml_libdir: Path
) -> None:
    """Regression: a GPU whose XID errors do not reach the supervisor (``xids_watched`` false:
    NVML does not deliver them, here its event types are not supported) looked like any other
    on the page, though its XIDs act on nothing. Its row says "XIDs not watched", as a
    warning, with why it matters; a watched GPU's does not."""
    world = tmp_path / "sim"
    SimBackend(world, 2).open()
    with (world / "gpus" / "1").open("a") as fh:
        fh.write("rc_nvmlDeviceGetSupportedEventTypes 3\n")
    config = page_config(tmp_path)
    config["gpu"]["backend"] = "nvml"
    config["workers"] = [w for w in config["workers"] if w["name"] == "c"]
    sup = supervisor(
        config, env={"GPU_SUPERVISOR_SIM_DIR": str(world), "LD_LIBRARY_PATH": str(fake_nvml_libdir)}
    )
    sup.ready("c-0")
    sup.wait_event(event="gpu.xids_unwatched")
    with sup.api() as http:
        devices = http.get("/api/v1/gpu/status").json()["devices"]
    assert [d["xids_watched"] for d in devices] == [True, False]
    browser.get(sup.api_url() + "/")
    chips = wait_for(
        browser,
        "GPU 1 flagged",
        lambda: (
            len(gpu_rows(browser)) == 2
            and any(c[0] == "XIDs not watched" for c in gpu_chips(browser)[1])
            and gpu_chips(browser)
        ),
    )
    assert [c[0] for c in chips[0]] == ["healthy"]
    assert [c[0] for c in chips[1]] == ["healthy", "XIDs not watched"]
    (_, cls, title) = chips[1][1]
    assert cls.split() == ["chip", "warn"]  # as cordoned and suspect are
    assert title and "gpu.xids_unwatched" in title
    assert_no_console_errors(browser)
    assert sup.stop() == 0


@pytest.mark.timeout(120)
def test_page_with_auth_read_takes_the_token_from_the_fragment(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    from selenium.webdriver.common.by import By

    sup = start(supervisor, page_config(tmp_path, **token_api(tmp_path)))
    url = sup.api_url() + "/"

    def auth_prompt() -> bool:
        return status_of(browser) == "auth" and browser.find_element(By.ID, "auth").is_displayed()

    def rendered() -> bool:
        shown = rows(browser)
        return set(shown) == set(WORKERS) and all(r["state"] == "ready" for r in shown.values())

    # Without a token: the navigation answers 401 and the page asks for the token.
    browser.get(url)
    wait_for(browser, "the token prompt", auth_prompt)
    status = browser.execute_script(
        "return performance.getEntriesByType('navigation')[0].responseStatus"
    )
    assert status == 401
    assert rows(browser) == {}

    # Opened with #token=...: it renders, and the token leaves the address bar for localStorage.
    browser.get("about:blank")
    browser.get(f"{url}#token={TOKEN}")
    wait_for(browser, "the workers with the token", rendered)
    assert "token" not in browser.current_url
    assert browser.execute_script("return localStorage.getItem('gpu-supervisor.token')") == TOKEN

    # A reload without the fragment still works (the stored token).
    browser.get(url)
    wait_for(browser, "the workers after a reload", rendered)

    # Forget it: the prompt again; type it into the form: the workers again.
    browser.find_element(By.ID, "forget").click()
    wait_for(browser, "the prompt after forgetting", auth_prompt)
    assert browser.execute_script("return localStorage.getItem('gpu-supervisor.token')") is None
    browser.find_element(By.ID, "auth-token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#auth-form button").click()
    wait_for(browser, "the workers with the typed token", rendered)
    assert not browser.find_element(By.ID, "auth").is_displayed()
    assert_no_console_errors(browser)
    assert sup.stop() == 0


@pytest.mark.timeout(120)
def test_page_shows_a_workers_output_and_follows_it_across_a_restart(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    sup = start(supervisor, page_config(tmp_path))
    first = sup.ready("c-0")["pid"]
    browser.get(sup.api_url() + "/")
    wait_for(browser, "the workers", lambda: set(rows(browser)) == set(WORKERS))
    assert browser.execute_script("return document.getElementById('log').hidden") is True

    open_output(browser, "c-0")
    wait_for(
        browser,
        "c-0's output",
        lambda: (
            f"--- gpu-supervisor: started pid {first} ---" in log_text(browser)
            and f"c-0 {first} ready" in log_text(browser)
        ),
    )
    assert browser.execute_script("return document.getElementById('log-name').textContent") == (
        "c-0"
    )
    mark = sup.mark()
    with sup.api() as http:
        assert http.post("/api/v1/workers/c-0/restart").status_code == 202
    again = sup.ready("c-0", after=mark)["pid"]
    wait_for(browser, "the restart followed", lambda: f"c-0 {again} ready" in log_text(browser))
    text = log_text(browser)
    assert text.count(f"c-0 {first} ready") == 1  # followed on, nothing shown twice
    assert text.index(f"c-0 {first} ready") < text.index(f"started pid {again} ---")
    browser.execute_script("document.getElementById('log-close').click()")
    assert browser.execute_script("return document.getElementById('log').hidden") is True
    assert_no_console_errors(browser)
    assert sup.stop() == 0


@pytest.mark.timeout(120)
def test_page_shows_a_character_split_between_two_reads_whole(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    # "é" is two bytes in UTF-8: the first comes at start, the second when SIGUSR1 says so
    split = [
        sys.executable,
        "-c",
        "import os, signal, time\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: os.write(1, b'\\xa9 after\\n'))\n"
        "os.write(1, b'before caf\\xc3')\n"
        "while True: time.sleep(60)\n",
    ]
    config = page_config(tmp_path)
    config["workers"] = [{"name": "u", "command": split, "ready": "none", "stop_timeout_s": 2}]
    sup = supervisor(config)
    sup.wait_event(event="worker.spawned", worker="u-0")
    browser.get(sup.api_url() + "/")

    open_output(browser, "u-0")
    wait_for(browser, "the first part", lambda: "before caf" in log_text(browser))
    with sup.api() as http:
        assert http.post("/api/v1/workers/u-0/signal?signal=SIGUSR1").status_code == 200
    wait_for(browser, "the rest", lambda: "after" in log_text(browser))
    assert "before caf\u00e9 after" in log_text(browser) and "\ufffd" not in log_text(browser)
    assert_no_console_errors(browser)
    assert sup.stop() == 0


@pytest.mark.timeout(120)
def test_page_says_so_when_the_supervisor_stops_answering(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    """A wedged supervisor (here stopped with SIGSTOP) takes the page's requests and never
    answers them. Regression: the page waited for them for ever, polled no more and went on
    saying "updated <time>" over what it last read; it says now that the API does not answer
    (and carries on once it does)."""
    import signal

    config = page_config(tmp_path)
    config["workers"] = [config["workers"][1]]  # c: no GPU
    sup = supervisor(config)
    sup.ready("c-0")
    browser.get(sup.api_url() + "/")
    wait_for(browser, "c-0", lambda: set(rows(browser)) == {"c-0"})
    assert status_of(browser) == "ok"
    sup.signal(signal.SIGSTOP)
    try:
        wait_for(
            browser,
            "the page to say the API does not answer",
            lambda: status_of(browser) == "error",
        )
        line = browser.execute_script("return document.getElementById('status-line').textContent")
        assert "no answer in 5 s" in line and "showing data from" in line, line
    finally:
        sup.signal(signal.SIGCONT)
    wait_for(browser, "the page to read the API again", lambda: status_of(browser) == "ok")
    assert sup.stop() == 0


def event_seqs(driver: Chrome) -> set[tuple[int, str]]:
    """The (seq, type) of every event row shown."""
    found: list[list[Any]] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#events tbody tr[data-type]'),"
        " tr => [Number(tr.dataset.seq), tr.dataset.type])"
    )
    return {(int(seq), str(kind)) for seq, kind in found}


def api_events(sup: Supervisor) -> set[tuple[int, str]]:
    with sup.api() as http:
        return {(e["seq"], e["type"]) for e in http.get("/api/v1/events").json()}


@pytest.mark.timeout(120)
def test_page_starts_over_for_a_restarted_supervisor_whatever_its_uptime(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    """A supervisor restarted behind an open page numbers its events from 1 again. Regression:
    the page knew a restart only by a smaller uptime, so a tab the browser had frozen or
    throttled for longer than the old run's uptime asked the new run for events after the
    old run's last number: the new run's first ones never showed, and the old run's stayed.
    The events' ``X-Gpu-Supervisor-Run`` says it whatever the uptimes."""
    config = page_config(tmp_path)
    config["workers"] = [config["workers"][1]]  # c: no GPU
    first = supervisor(config)
    first.ready("c-0")
    url = first.api_url()
    mark = first.mark()
    with first.api() as http:  # more events in the first run than the second will have
        assert http.post("/api/v1/workers/c-0/restart").status_code == 202
    first.ready("c-0", after=mark)
    browser.get(url + "/")
    browser.execute_script("document.getElementById('all-events').click()")
    old = api_events(first)
    wait_for(browser, "the first run's events", lambda: event_seqs(browser) == old)
    browser.execute_cdp_cmd("Page.setWebLifecycleState", {"state": "frozen"})
    with first.api() as http:
        uptime = http.get("/healthz").json()["uptime_s"]
    assert first.stop() == 0
    config["api"] = {"listen": url.removeprefix("http://")}  # the same address
    second = supervisor(config)
    second.ready("c-0")
    # up longer than the first run was when the page last read it: the uptime says nothing
    second.wait_api("/healthz", lambda health: health["uptime_s"] > uptime)
    new = api_events(second)
    assert max(new)[0] < max(old)[0], (new, old)
    browser.execute_cdp_cmd("Page.setWebLifecycleState", {"state": "active"})
    wait_for(browser, "the second run's events alone", lambda: event_seqs(browser) == new)
    assert_no_console_errors(browser)
    assert second.stop() == 0


#: Injected before the page's own script: the page's wall clock (``Date.now()``, ``new Date()``)
#: runs ``window.__stepClock(ms)`` ahead of (or behind) the real one, as NTP or a resume steps it.
STEPPED_CLOCK = """
(() => {
  const Real = Date, realNow = Real.now.bind(Real);
  let offset = 0;
  window.__stepClock = (ms) => { offset += ms; };
  class Stepped extends Real {
    constructor(...args) { if (args.length) { super(...args); } else { super(realNow() + offset); } }
    static now() { return realNow() + offset; }
  }
  window.Date = Stepped;
})();
"""


def sparkline_of(driver: Chrome, worker: str) -> tuple[int, list[tuple[float, float]], float]:
    """``worker``'s sparkline: its sample count, the points its path draws, and its width."""
    samples, d, width = driver.execute_script(
        "const s = document.querySelector(`tr[data-worker='${arguments[0]}'] svg.spark`);"
        " const p = s && s.querySelector('path');"
        " return s ? [Number(s.dataset.samples), p ? p.getAttribute('d') : '',"
        " Number(s.getAttribute('width'))] : [0, '', 0]",
        worker,
    )
    numbers = [float(n) for n in re.findall(r"-?[\d.]+(?:e[-+]?\d+)?", d)]
    return int(samples), list(zip(numbers[::2], numbers[1::2], strict=True)), float(width)


@pytest.mark.timeout(120)
def test_page_sparklines_survive_a_step_of_the_viewers_clock(
    supervisor: SupervisorFactory, tmp_path: Path, browser: Chrome
) -> None:
    """Regression: the sparklines timed their samples with the browser's wall clock. Stepped
    back (NTP, a VM resumed), the samples before the step were "in the future" and drawn far
    off the chart until they aged out (13 min); stepped forward, the whole history was thrown
    away as older than the 10-minute window. They are timed with a monotonic clock now."""
    config = page_config(tmp_path)
    config["workers"] = [config["workers"][0] | {"replicas": 1}]  # g-0: GPU memory samples
    sup = supervisor(config)
    sup.ready("g-0")
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": STEPPED_CLOCK})
    browser.get(sup.api_url() + "/")

    def polls() -> int:
        return int(browser.execute_script("return Number(document.body.dataset.polls)"))

    def step_and_poll(ms: int) -> tuple[int, list[tuple[float, float]], float]:
        """Step the page's clock by ``ms``, have it poll at once (an empty ``#token=`` does
        that and stores nothing), and return the sparkline that poll drew."""
        seen = polls()
        browser.execute_script(f"window.__stepClock({ms}); window.location.hash = 'token='")
        wait_for(browser, "a poll after the step", lambda: polls() > seen)
        return sparkline_of(browser, "g-0")

    wait_for(browser, "g-0's first sample", lambda: sparkline_of(browser, "g-0")[0] >= 1)
    count, points, width = step_and_poll(-3600 * 1000)  # an hour back
    assert count >= 2 and len(points) == count, (count, points)
    assert all(0 <= x <= width for x, _ in points), points  # none off the chart
    after, points, width = step_and_poll(2 * 3600 * 1000)  # two hours on
    assert after > count, (after, count)  # the samples before the step are kept
    assert all(0 <= x <= width for x, _ in points), points
    assert_no_console_errors(browser)
    assert sup.stop() == 0
