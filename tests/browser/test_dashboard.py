"""The dashboard in a real headless Chromium (Debian's), against a live toy sampler with an
API key. The page must work with nothing but the sampler: any console error the test did
not provoke, a script error, or a request to another origin fails it."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from support import drain, rows_with, write_jsonl

from trainer_client.launch import SamplerProcess

#: The engine's fault hook: every generate call fails while the file it names exists.
FAULT_ENGINE_ERRORS_ENV = "ADAPTIVE_ROLLOUT_FAULT_ENGINE_ERRORS"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

KEY = "dashboard-test-key"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
#: Background traffic, updates, sync and QUIC off: the browser makes only the page's requests.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", "test-artifacts")) / "browser"
WAIT_S = 120.0


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.25)
    pytest.fail(f"waited {timeout_s:.0f} s for {what}")


@pytest.fixture(scope="module")
def sampler(toy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SamplerProcess]:
    tmp_path = tmp_path_factory.mktemp("sampler")
    server = SamplerProcess(
        toy.model_dir,
        toy.data_files,
        tmp_path / "state",
        {
            "max_tokens": 8,
            "max_active_prompts": 8,
            "max_buffered_groups": 256,
            "max_staleness": None,  # the stand-in trainer acks without training
        },
        tmp_path / "sampler.log",
        extra=["--api-key", KEY],
        # Absent until the test makes the engine fail.
        env={FAULT_ENGINE_ERRORS_ENV: str(tmp_path / "engine-errors")},
    )
    server.start()
    # A trainer that acks what it is given, so the run stays live: without one the sampler
    # stops at max_buffered_groups, on a fast machine before the page is looked at.
    stop = threading.Event()

    def train() -> None:
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60.0
        ) as client:
            while not stop.wait(1.0):
                drain(client, consumer="dashboard-test-trainer")

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    yield server
    stop.set()
    trainer.join(timeout=90)
    server.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not shutil.which(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test-browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    # Playwright gives every launch a fresh temporary profile (--user-data-dir).
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def test_dashboard(sampler: SamplerProcess, browser: Any, toy: Any) -> None:
    api = httpx.Client(
        base_url=sampler.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60.0
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    console_errors: list[str] = []
    requests: list[str] = []
    page.on(
        "console",
        lambda m: (
            console_errors.append(f"{m.text} ({m.location.get('url')})")
            if m.type == "error"
            else None
        ),
    )
    page.on("pageerror", lambda exc: console_errors.append(f"uncaught: {exc}"))
    page.on("request", lambda r: requests.append(r.url))

    # With a key configured the page asks for it and fetches no data without it.
    response = page.goto(f"{sampler.url}/dashboard")
    assert response is not None and response.status == 200
    assert "default-src 'self'" in response.headers["content-security-policy"]
    wait_for("the API key prompt", lambda: page.is_visible("#key-panel"))
    time.sleep(3)  # past a refresh: still nothing but /health
    assert page.is_hidden("#content")
    assert page.locator("#domains tbody tr").count() == 0
    assert not [u for u in requests if "/v1/" in u]

    page.fill("#key-input", KEY)
    page.click("#key-submit")
    wait_for("the domain table", lambda: page.locator("#domains tbody tr").count() == 3)
    assert page.locator("#domains tbody td:first-child").all_inner_texts() == [
        "add1",
        "add2",
        "mul",
    ]
    first = page.inner_text("#total-samples")
    wait_for("the answers counter to move", lambda: page.inner_text("#total-samples") != first)
    assert page.inner_text("#health") == "ok"
    assert page.is_hidden("#replicas-panel")  # one engine in the sampler's process
    assert page.is_hidden("#episodes-panel")  # single answers: no episodes
    # Where the decoded tokens went, as /v1/stats counts them.
    wait_for("the token figures", lambda: "decoded" in page.inner_text("#tokens"))
    tokens = page.inner_text("#tokens")
    assert all(part in tokens for part in ("trained", "waste: surplus", "waste: stale", "pending"))
    # ... and the waste by pass-rate bin and by domain, one row each, a column per cause.
    waste_by = page.inner_text("#waste-by")
    assert all(part in waste_by for part in ("q1", "q4", "unseen", "stale", "crash"))
    # The time charts run from the page's first sample, a minute at least: not over years
    # (uPlot's own range for a lone point).
    for chart in ("rates", "queue"):
        low, high, first_t, last_t = page.evaluate(
            f"[state.charts.{chart}.scales.x.min, state.charts.{chart}.scales.x.max, "
            "state.history.t[0], state.history.t[state.history.t.length - 1]]"
        )
        assert low == first_t and high == max(last_t, first_t + 60), (chart, low, high)
    # Rates and queue depths are read against zero; the histogram's ticks are whole numbers.
    for chart, scale in (("rates", "y"), ("rates", "a"), ("queue", "y"), ("hist", "y")):
        assert page.evaluate(f"state.charts.{chart}.scales.{scale}.min") == 0, (chart, scale)
    wait_for(
        "the histogram to draw",
        lambda: page.evaluate("state.charts.hist.axes[0]._splits?.length ?? 0") > 1,
    )
    for axis in (0, 1):
        ticks = page.evaluate(f"state.charts.hist.axes[{axis}]._splits")
        assert ticks and all(float(t).is_integer() for t in ticks), (axis, ticks)

    # The key was asked for once: a reload keeps it (sessionStorage) and shows data again.
    page.reload()
    wait_for("data after a reload", lambda: page.locator("#domains tbody tr").count() == 3)
    assert page.is_hidden("#key-panel")

    # A k_pos change through the form is one PATCH that GET /v1/config then shows.
    wait_for("the form to fill", lambda: page.input_value("#f-k_pos") == "2")
    page.fill("#f-k_pos", "1")
    page.click("#apply")
    wait_for("the change to apply", lambda: "applied" in page.inner_text("#form-status"))
    config = api.get("/v1/config").json()
    assert (config["k_pos"], config["config_version"]) == (1, 1)
    wait_for("the change in the event list", lambda: "k_pos 2 → 1" in page.inner_text("#events"))
    assert page.inner_text("#config-version") == "1"
    assert not console_errors, console_errors

    # An invalid value shows the server's own message next to the field; nothing changes.
    expected = api.patch("/v1/config", json={"k_pos": 99}).json()["error"]["message"]
    page.fill("#f-k_pos", "99")
    page.click("#apply")
    shown = wait_for(
        "the error next to k_pos",
        lambda: page.inner_text('.field-error[data-field="k_pos"]'),
    )
    assert shown == f"422 {expected}"
    assert api.get("/v1/config").json()["config_version"] == 1
    # Chromium reports the refused PATCH itself as a console error; it must be the only one.
    assert len(console_errors) == 1 and "status of 422" in console_errors[0], console_errors

    # Someone else changes the config while the form holds edits: the form's PATCH carries
    # the version it was filled from, so it is refused (409) instead of undoing that change.
    assert api.patch("/v1/config", json={"k_neg": 1}).json()["config_version"] == 2
    page.fill("#f-k_pos", "2")
    page.click("#apply")
    conflict = wait_for("the 409 message", lambda: page.inner_text("#form-status"))
    assert conflict == "409 config_version is 2, not 1"
    assert api.get("/v1/config").json()["k_pos"] == 1
    assert "status of 409" in console_errors[-1], console_errors
    page.click("#reset")
    wait_for("the live values", lambda: page.input_value("#f-k_neg") == "1")
    assert page.input_value("#f-k_pos") == "1"
    assert page.inner_text("#form-status") == ""

    # One kind of event at a time: weight updates do not bury the config changes.
    weights = (toy.model_dir / "model.safetensors").read_bytes()
    for version in (1, 2, 3):
        assert api.put("/v1/weights", params={"version": version}, content=weights).is_success
    wait_for("the weight updates", lambda: "v3 via upload" in page.inner_text("#events"))
    page.select_option("#event-kind", "config")
    shown = page.locator("#events li").all_inner_texts()
    assert shown and all(t.startswith("config") for t in shown), shown
    assert "k_pos 2 → 1" in page.inner_text("#events")
    page.select_option("#event-kind", "")
    # max_tokens is in the form too.
    page.fill("#f-max_tokens", "7")
    page.click("#apply")
    wait_for("max_tokens to apply", lambda: api.get("/v1/config").json()["max_tokens"] == 7)
    # A warning shows until its cause ends: here an engine failing its calls.
    assert page.is_hidden("#warnings-panel")
    fault = Path(sampler.env[FAULT_ENGINE_ERRORS_ENV])
    fault.touch()
    wait_for("the warning", lambda: page.is_visible("#warnings-panel"))
    assert "engine: " in page.inner_text("#warnings") and "fault hook" in page.inner_text(
        "#warnings"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    fault.unlink()
    wait_for("the warning to clear", lambda: page.is_hidden("#warnings-panel"))
    origin = urlsplit(sampler.url)
    foreign = [u for u in requests if urlsplit(u)[:2] != origin[:2] and not u.startswith("data:")]
    assert not foreign, foreign
    api.close()


def test_the_dashboard_lists_the_engine_servers_of_backend_http(
    sampler: SamplerProcess, browser: Any, toy: Any, tmp_path: Path
) -> None:
    """With `--backend http` the servers are in /v1/stats under engine.servers (no Ray
    replicas): the replicas panel lists them. The sampler's own stats are served with the
    server list of an HTTP engine backend (its real rows) spliced in."""
    from sampler_service.backends.checkpoint import read_checkpoint
    from sampler_service.backends.http.member import HTTPMember, Servers
    from sampler_service.backends.http.transport import HTTPPoolSettings, HTTPTransport
    from sampler_service.config import ReplicaSettings
    from sampler_service.fleet.table import Table
    from sampler_service.metrics import Metrics

    urls = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    transport = HTTPTransport(
        toy.model_dir,
        HTTPPoolSettings(urls=urls, instance_id="dashboard-test", weights_dir=tmp_path),
    )
    shared = Servers(
        "dashboard-test", toy.model_dir, read_checkpoint(toy.model_dir), ReplicaSettings()
    )
    table = Table(transport, Metrics(), changed=lambda: None, failed=lambda seat: None)
    for url in urls:  # two servers not reached yet, as the fleet's table lists them
        table.add(HTTPMember(url, shared))
    servers = table.rows()
    servers[0] |= {
        "state": "ok",
        "inflight_samples": 24,
        "policy_version": 3,
        "waves": 40,
        "mean_wave_s": 1.25,
    }
    servers[1] |= {"state": "down", "error": "ConnectError('refused')", "reissued_waves": 2}

    def with_servers(route: Any) -> None:
        response = route.fetch()
        stats = response.json()
        stats["replicas"] = None
        stats["engine"] = {**stats["engine"], "servers": servers}
        route.fulfill(response=response, json=stats)

    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.route("**/v1/stats", with_servers)
    page.goto(f"{sampler.url}/dashboard")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    wait_for("the server list", lambda: page.locator("#replicas tbody tr").count() == 2)
    assert page.inner_text("#replicas-title") == "Engine servers"
    header = page.locator("#replicas thead th").all_inner_texts()
    for column in ("url", "state", "inflight_samples", "mean_wave_s", "policy_version"):
        assert column in header, header
    rows = [
        dict(zip(header, row.locator("td").all_inner_texts(), strict=True))
        for row in page.locator("#replicas tbody tr").all()
    ]
    assert [r["state"] for r in rows] == ["ok", "down"]
    assert rows[0]["url"] == "http://10.0.0.1:8000"
    assert (rows[0]["inflight_samples"], rows[0]["policy_version"]) == ("24", "3")
    assert rows[0]["mean_wave_s"] == "1.25" and rows[1]["reissued_waves"] == "2"
    assert not errors, errors


def _episode_rows(stats: dict[str, Any]) -> dict[str, str] | None:
    """The episodes panel's rows as the page must write /v1/stats `episodes`; None before
    the first episode has finished (the panel is hidden then)."""
    ep = stats["episodes"]
    model, observation = ep["model_tokens"], ep["observation_tokens"]
    if not ep["episodes"]:
        return None
    share = 100 * (observation / (model + observation))
    return {
        "episodes": str(ep["episodes"]),
        "turns per episode": "2",  # every finished Retell episode has two turns
        "environment errors": f"{ep['env_errors']} (last: {ep['last_env_error']})",
        "environment seconds": f"{ep['env_seconds']:.1f}",
        "model / observation tokens": f"{model} / {observation} ({share:.0f}% observation)",
    }


def test_the_episodes_panel_shows_what_episodes_cost(
    make_server: Callable[..., Any], browser: Any, toy: Any, tmp_path: Path
) -> None:
    """A sampler answering by episodes whose tool fails now and then (`raises`: every
    third step): the panel shows turns per episode, environment errors with the last one,
    and model vs observation tokens, as /v1/stats has them once the run stops (its buffer
    is full: nothing consumes)."""
    data = write_jsonl(
        tmp_path / "episodes.jsonl",
        rows_with(toy.data_files[1], env="python:episode_envs:raises"),
    )
    config = {"rule": "fixed", "n_max": 4, "wave_size": 4, "group_size": 4}
    # Turns of at most 8 tokens: every episode has room for both turns in the toy's context.
    server = make_server(
        {**config, "max_buffered_groups": 2, "episode": {"max_tokens_per_turn": 8}}, data=[data]
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.goto(f"{server.url}/dashboard")
    with server.client() as api:

        def shown() -> dict[str, str] | None:
            cells = [r.locator("td").all_inner_texts() for r in page.locator("#episodes tr").all()]
            rows = {label: value for label, value in cells}
            expected = _episode_rows(api.get("/v1/stats").json())
            return rows if expected is not None and rows == expected else None

        rows = wait_for("the episodes panel to show the stopped run's figures", shown)
        episodes = api.get("/v1/stats").json()["episodes"]
    assert page.is_visible("#episodes-panel")
    assert episodes["env_errors"] > 0 and "the tool crashed" in rows["environment errors"]
    assert episodes["observation_tokens"] > 0 and episodes["env_seconds"] > 0
    assert not errors, errors


def test_the_api_reference_renders_with_nothing_but_the_sampler(
    sampler: SamplerProcess, browser: Any
) -> None:
    """/docs (Swagger UI) on a machine with no network: every script and style comes from
    the sampler, and the page shows the sampler's operations."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
    page.on("request", lambda r: requests.append(r.url))
    response = page.goto(f"{sampler.url}/docs")
    assert response is not None and response.status == 200
    wait_for("the operations", lambda: page.locator(".opblock").count() >= 10)
    assert "adaptive-rollout sampler" in page.inner_text(".info .title")
    assert "/v1/groups/lease" in page.inner_text("#swagger-ui")
    origin = urlsplit(sampler.url)
    foreign = [u for u in requests if urlsplit(u)[:2] != origin[:2] and not u.startswith("data:")]
    assert not foreign, foreign
    assert not problems, problems
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "docs.png"))
