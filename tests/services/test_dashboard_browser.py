"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
Playwright through ``executable_path``) against a real ``apportion up`` stack.

It signs in through the login form, loads every page, submits a workload through
the queue page's form, watches it get placed (the page updates itself), checks
the queue's reason codes against the API's, holds and releases a workload,
filters the queue, drains, downs and undrains nodes as an operator (and sees a
non-operator get no actions), cancels a workload and searches the Jobs page's
ended and filtered views, edits a budget, checks that the charts are drawn (SVG
elements) and that no page logs a script error or a Content-Security-Policy
violation. Screenshots go to
``build/screenshots/``.

The test skips only when no Chromium can be found or installed (``make test``
installs Debian's ``chromium`` when it runs as root; so does this test).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.browser]

APPORTION = [sys.executable, "-m", "apportion"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    named = os.environ.get("APPORTION_CHROMIUM")
    if named:
        return named if Path(named).exists() else None
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_or_install() -> tuple[str | None, str]:
    """The browser's path, or ``None`` and why none could be had."""
    named = os.environ.get("APPORTION_CHROMIUM")
    if named and not Path(named).exists():
        return None, f"$APPORTION_CHROMIUM names {named}, which does not exist"
    found = find_chromium()
    if found:
        return found, ""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "no chromium on PATH, and not root with apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        done = subprocess.run(
            ["apt-get", "install", "-y", "-qq", "chromium"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"no chromium, and apt-get install chromium failed: {exc}"
    found = find_chromium()
    if found:
        return found, ""
    return None, f"no chromium, and apt-get install chromium failed: {done.stderr.strip()[-300:]}"


def api(url: str, path: str, token: str) -> Any:
    """``GET`` a JSON answer of the gateway's API with ``token``."""
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = chromium_or_install()
    if path is None:
        pytest.skip(f"no browser for the dashboard test: {why}")
    return path


@pytest.fixture
def stack(nats_server, tmp_path: Path, cluster: str) -> Iterator[tuple[str, Path]]:
    """`apportion up` with the demo cluster under a fresh name; yields (gateway URL, data dir)."""
    from apportion.services.stack import DEMO_CLUSTER_TOML

    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(DEMO_CLUSTER_TOML.replace('name = "demo"', f'name = "{cluster}"'))
    env = {**os.environ, "NATS_URL": nats_server.url}
    env.pop("APPORTION_URL", None)
    data = tmp_path / "data"
    err = open(tmp_path / "up.err", "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen(
        APPORTION
        + ["up", "--cluster", str(cluster_file), "--data-dir", str(data), "--port", "0"]
        + ["--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        err.seek(0)
        m = re.search(r"gateway: (http://\S+)", err.read())
        url = m.group(1) if m else None
        time.sleep(0.05)
    assert url, f"apportion up did not print its gateway URL: {(tmp_path / 'up.err').read_text()}"
    try:
        yield url, data
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        err.close()


def test_the_dashboard_in_a_browser(chromium: str, stack: tuple[str, Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, data = stack
    admin = (data / "credentials" / "admin.token").read_text().strip()
    victor = (data / "credentials" / "victor.token").read_text().strip()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    timings: dict[str, float] = {}
    started = time.monotonic()

    def shot(page, name: str) -> None:
        page.screenshot(path=str(SCREENSHOTS / f"dashboard-{name}.png"), full_page=True)

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.set_default_timeout(20_000)
            page = context.new_page()
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "response",
                lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
            )
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console {msg.type}: {msg.text}")
                    if msg.type == "error"
                    else None
                ),
            )

            # 1. an unauthenticated visit lands on the login form; a wrong token is refused
            t = time.monotonic()
            page.goto(url + "/")
            expect(page).to_have_url(re.compile(r"/ui/login\?next="))
            page.fill("input[name=token]", "apt_not-a-token")
            page.click("#login-form button")
            expect(page.locator(".flash.error")).to_contain_text("unknown or revoked token")
            # the refusal is a 401 page: the only failed request so far
            assert all("401" in x for x in problems) and problems, problems
            problems.clear()
            shot(page, "login")
            page.fill("input[name=token]", admin)
            page.click("#login-form button")
            expect(page).to_have_url(re.compile(r"/ui/$"))
            expect(page.locator("header .who")).to_contain_text("admin")
            cookies = {c["name"]: c for c in context.cookies()}
            cookie = cookies["apportion_token"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert page.evaluate("document.cookie") == ""  # scripts cannot read the token
            timings["login"] = time.monotonic() - t

            # 2. the cluster page: tiles, node bars, the timeline chart
            expect(page.locator("svg#gpu-timeline")).to_be_visible()
            assert page.locator("svg#gpu-timeline polygon.allocated").count() == 1
            assert page.locator("svg#gpu-timeline polygon.unallocated").count() == 1
            expect(page.locator("table.nodes tr")).to_have_count(6 + 1)  # one header row
            assert page.locator("table.nodes svg.bar").count() == 6
            shot(page, "cluster-empty")

            # 3. submit through the queue page's form; the workload page shows it placed
            t = time.monotonic()
            page.click("nav a[href='/ui/queue']")
            expect(page.locator("h1")).to_have_text("Queue")
            form = page.locator("#submit-form")
            form.locator("select[name=owner]").select_option("llm/pretrain")
            form.locator("input[name=gpus]").fill("16")
            form.locator("select[name=gpu_type]").select_option("h100")
            form.locator("input[name=min_runtime]").fill("1h")
            form.locator("input[name=id]").fill("ui-job-1")
            form.locator("button[type=submit]").click()
            expect(page).to_have_url(re.compile(r"/ui/workload/ui-job-1"))
            expect(page.locator(".flash")).to_contain_text("submitted ui-job-1")
            # the page polls /ui/live and shows the placement without a reload
            expect(page.locator("#wl-status")).to_have_text("running", timeout=30_000)
            expect(page.locator("#live")).to_contain_text("running on h100-")
            # the script polled /ui/live with the cookie (it marks the body when it does)
            expect(page.locator("body")).to_have_attribute(
                "data-input-seq", re.compile(r"^\d+$"), timeout=10_000
            )
            expect(page.locator("#live")).to_contain_text("protected from preemption until")
            timings["submit to placed"] = time.monotonic() - t
            shot(page, "workload")

            # free (preemptible) work on the other H100s; allocated work that preempts
            # it; and one that must wait (32 GPUs while ui-job-1 is protected)
            for wid, gpus, mr in (
                ("ui-free", "16", "0"),
                ("ui-paid", "16", "15m"),
                ("ui-wait", "32", "2h"),
            ):
                page.goto(url + "/ui/queue")
                form = page.locator("#submit-form")
                form.locator("select[name=owner]").select_option("vision/detection")
                form.locator("input[name=gpus]").fill(gpus)
                form.locator("select[name=gpu_type]").select_option("h100")
                form.locator("input[name=min_runtime]").fill(mr)
                form.locator("input[name=id]").fill(wid)
                form.locator("button[type=submit]").click()
                expect(page).to_have_url(re.compile(rf"/ui/workload/{wid}"))
                if wid != "ui-wait":
                    expect(page.locator("#wl-status")).to_have_text("running", timeout=30_000)
            page.goto(url + "/ui/workload/ui-free")
            expect(page.locator("#wl-status")).to_have_text("pending")
            expect(page.locator("ul.reasons")).to_contain_text("to make room for ui-paid")

            # 4. the queue: running rows, the pending one with its position and sort key
            page.goto(url + "/ui/queue")
            running = page.locator("table.running")
            expect(running).to_contain_text("ui-job-1")
            pending = page.locator("table.queue")
            expect(pending).to_contain_text("ui-wait")
            expect(pending).to_contain_text("ui-free")  # requeued: preempted, resumable
            # each pending row shows the reason code the API gives, beside its sentence
            codes = {r["workload"]: r["reason"] for r in api(url, "/v1/queue", admin)["pending"]}
            assert {"ui-wait", "ui-free"} <= set(codes), codes
            for wid, code in codes.items():
                row = pending.locator(f"tr[data-workload='{wid}']")
                expect(row.locator("code.reason-code")).to_have_text(code)
                expect(row.locator("td.why small")).not_to_be_empty()
            shot(page, "queue")

            # hold ui-wait from its row: marked held, its code `held`; then release it
            t = time.monotonic()
            wait_row = pending.locator("tr[data-workload='ui-wait']")
            wait_row.locator("form.hold button").click()
            expect(page.locator(".flash")).to_contain_text("hold of ui-wait sent")
            expect(wait_row.locator("code.reason-code")).to_have_text("held", timeout=30_000)
            expect(wait_row.locator(".badge.held")).to_have_text("held")
            expect(wait_row).to_have_class(re.compile(r"\bheld\b"))
            expect(wait_row.locator("form.release button")).to_be_visible()
            shot(page, "queue-held")
            wait_row.locator("form.release button").click()
            expect(page.locator(".flash")).to_contain_text("release of ui-wait sent")
            expect(wait_row.locator(".badge.held")).to_have_count(0, timeout=30_000)
            expect(wait_row.locator("code.reason-code")).not_to_have_text("held")
            expect(wait_row.locator("form.hold button")).to_be_visible()
            timings["hold and release"] = time.monotonic() - t

            # the queue filtered: team llm has nothing pending and runs ui-job-1 only
            page.locator("#queue-filter input[name=team]").fill("llm")
            page.locator("#queue-filter button[type=submit]").click()
            expect(page).to_have_url(re.compile(r"/ui/queue\?.*team=llm"))
            expect(page.locator("#queue-count")).to_contain_text("0 of 2 pending")
            expect(page.locator("table.running")).to_contain_text("ui-job-1")
            expect(page.locator("table.running")).not_to_contain_text("ui-paid")
            shot(page, "queue-filtered")
            page.goto(url + "/ui/queue")

            # the workload page answers why it waits
            page.click("table.queue a[href='/ui/workload/ui-wait']")
            expect(page.locator("#wl-status")).to_have_text("pending")
            expect(page.locator("ul.reasons")).to_contain_text("position 1")
            shot(page, "workload-pending")

            # 5. the cluster page now shows work in use: solid and hatched areas, busy nodes
            page.goto(url + "/ui/")
            expect(page.locator(".tiles")).to_contain_text("GPUs in use")
            tl = page.locator("svg#gpu-timeline")
            expect(tl).to_be_visible()
            box = tl.bounding_box()
            assert box and box["width"] > 500 and box["height"] > 100
            expect(page.locator("table.nodes")).to_contain_text("ui-job-1")
            assert page.locator("svg#gpu-timeline line.capacity").count() == 1
            assert page.locator("svg#gpu-timeline path.preemption").count() == 1
            page.click("h2 small a[href='/ui/?hours=1']")
            expect(page).to_have_url(re.compile(r"hours=1$"))
            expect(page.locator("svg#gpu-timeline")).to_be_visible()
            assert page.locator("svg#gpu-timeline path.preemption").count() == 1
            shot(page, "cluster")

            # the node table: an operator (admin owns the budget root) drains a node
            t = time.monotonic()
            node = page.locator("tr[data-node='a100-001']")
            expect(node.locator(".node-state")).to_have_text("healthy")
            node.locator("input[name=reason]").fill("replace a fan")
            node.locator("button[value=draining]").click()
            expect(page.locator(".flash")).to_contain_text("a100-001: draining sent")
            expect(node.locator(".node-state")).to_have_text(
                re.compile(r"^draining"), timeout=30_000
            )
            expect(node.locator("td.change")).to_contain_text("by admin")
            expect(node.locator("td.change")).to_contain_text("replace a fan")
            expect(page.locator("h3.health.draining")).to_contain_text("draining (1)")
            expect(node.locator("button[value=healthy]")).to_have_text("Undrain")
            # the GPUs used / free of a busy node
            expect(page.locator("tr[data-node='h100-000'] td").nth(3)).to_contain_text("8 / 0")
            timings["drain"] = time.monotonic() - t
            shot(page, "nodes-drain")
            # a100-000 down, and back in service (Undrain)
            node = page.locator("tr[data-node='a100-000']")
            node.locator("button[value=down]").click()
            expect(node.locator(".node-state")).to_have_text("down", timeout=30_000)
            node.locator("button[value=healthy]").click()
            expect(node.locator(".node-state")).to_have_text("healthy", timeout=30_000)
            expect(node.locator("td.change")).to_contain_text("healthy by admin")

            # 6. usage against budget: the chart has a bar per budget node
            page.click("nav a[href='/ui/usage']")
            chart = page.locator("svg#usage-chart")
            expect(chart).to_be_visible()
            assert chart.locator("line.allocation").count() == 5  # llm, 2 leaves, vision, 1 leaf
            expect(page.locator("table.usage")).to_contain_text("llm/pretrain")
            # allocation usage over time: a chart per team (llm, vision), one scale
            expect(page.locator("svg.usage-history.team")).to_have_count(2)
            for team in ("llm", "vision"):
                hist = page.locator(f"svg#usage-history-{team}")
                expect(hist).to_be_visible()
                assert hist.locator("polygon.h-delivered").count() == 1
                assert hist.locator("path.h-owed").count() == 1
                assert hist.locator("path.h-used").count() == 1
                assert hist.locator("g.legend").count() == 1
                # a fresh cluster: the hours that hold data (this one, maybe the last),
                # not the whole lookback window, and a line under the heading says so
                assert 1 <= hist.locator("rect.hour").count() <= 2
            expect(page.locator("p.data-span")).to_contain_text("the data covers only")
            box = page.locator("svg#usage-history-llm").bounding_box()
            assert box and box["width"] > 500 and box["height"] > 80
            # llm has run ui-job-1 this hour: what it was delivered rises above the axis
            area = page.locator("svg#usage-history-llm polygon.h-delivered").bounding_box()
            assert area and area["height"] > 0.5, area
            expect(page.locator("table.usage-history")).to_contain_text("llm/pretrain")
            shot(page, "usage")
            page.click("h2 small a[href='/ui/usage?hours=24']")
            expect(page).to_have_url(re.compile(r"/ui/usage\?hours=24$"))
            hours = page.locator("svg#usage-history-llm rect.hour").count()
            assert 1 <= hours <= 2, hours
            # each user of a team on request (the live update keeps the choice)
            page.click("p.muted a:text-is('llm')")
            expect(page).to_have_url(re.compile(r"/ui/usage\?hours=24&team=llm$"))
            expect(page.locator("svg.usage-history.user")).to_have_count(2)
            expect(page.locator("svg#usage-history-llm-pretrain")).to_be_visible()
            expect(page.locator("body")).to_have_attribute(
                "data-input-seq", re.compile(r"^\d+$"), timeout=10_000
            )
            expect(page.locator("svg.usage-history.user")).to_have_count(2)
            shot(page, "usage-24h")

            # 7. the jobs page: ui-free cancelled (its button), then the ended and filtered views
            page.goto(url + "/ui/workload/ui-free")
            page.locator("#wl-actions form.cancel button").click()
            expect(page.locator(".flash")).to_contain_text("cancel of ui-free sent")
            expect(page.locator("#wl-status")).to_have_text("cancelled", timeout=30_000)
            page.click("nav a[href='/ui/jobs']")
            jobs = page.locator("table.jobs")
            expect(jobs.locator("tr:has(a[href='/ui/workload/ui-free']) .status")).to_have_text(
                "cancelled"
            )
            expect(jobs).not_to_contain_text("ui-job-1")  # ended only: it still runs
            shot(page, "jobs-ended")
            search = page.locator("#job-search")
            search.locator("input[name=team]").fill("vision")
            search.locator("select[name=state]").select_option("running")
            search.locator("button[type=submit]").click()
            expect(page).to_have_url(
                re.compile(r"team=vision.*state=running|state=running.*team=vision")
            )
            expect(page.locator("#jobs-count")).to_have_text("1 matched")
            expect(jobs).to_contain_text("ui-paid")
            shot(page, "jobs-filtered")
            page.click("#jobs-mine")  # submitted by admin, any state
            expect(page.locator("#jobs-count")).to_have_text("4 matched")
            search.locator("input[name=user]").fill("victor")
            search.locator("button[type=submit]").click()
            expect(page.locator("table.jobs")).to_have_count(0)
            expect(page.locator("#live .empty")).to_have_text("no job matches")

            # 8. the budget tree: the admin edits a weight; the page shows the new value
            t = time.monotonic()
            page.click("nav a[href='/ui/budget']")
            edit = page.locator("#edit-llm--finetune")
            edit.locator("input[name=weight]").fill("4")
            edit.locator("button[value=set]").click()
            expect(page.locator(".flash")).to_contain_text("llm/finetune saved")
            expect(page.locator("tr[data-path='llm/finetune'] td.weight")).to_have_text(
                "4", timeout=30_000
            )
            timings["budget edit"] = time.monotonic() - t
            shot(page, "budget")

            # victor owns vision: no form on llm, and his edit of vision/detection works
            page.click("header form button")  # sign out
            expect(page).to_have_url(re.compile(r"/ui/login"))
            page.goto(url + "/ui/budget")
            page.fill("input[name=token]", victor)
            page.click("#login-form button")
            expect(page).to_have_url(re.compile(r"/ui/budget$"))
            assert page.locator("#edit-llm--finetune").count() == 0
            edit = page.locator("#edit-vision--detection")
            edit.locator("input[name=weight]").fill("2")
            edit.locator("button[value=set]").click()
            expect(page.locator(".flash")).to_contain_text("vision/detection saved")
            # the fold refuses what he does not own even when posted by hand
            page.evaluate(
                """() => { const f = document.createElement('form'); f.method = 'post';
                f.action = '/ui/budget'; for (const [k, v] of [['path', 'llm'], ['weight', '9'],
                ['owner', 'victor'], ['action', 'set']]) { const i = document.createElement('input');
                i.name = k; i.value = v; f.appendChild(i); } document.body.appendChild(f); f.submit(); }"""
            )
            expect(page.locator(".flash.error")).to_contain_text("refused (403)")
            shot(page, "budget-refused")

            # victor is no operator: the node table without actions; posted by hand, refused
            page.click("nav a[href='/ui/']")
            node = page.locator("tr[data-node='a100-001']")
            expect(node.locator(".node-state")).to_have_text(re.compile(r"^draining"))
            expect(node.locator("td.change")).to_contain_text("replace a fan")
            assert page.locator("form.node-actions").count() == 0
            assert page.locator("table.nodes th:text-is('actions')").count() == 0
            shot(page, "nodes-victor")
            page.evaluate(
                """() => { const f = document.createElement('form'); f.method = 'post';
                f.action = '/ui/node/a100-000/health'; const i = document.createElement('input');
                i.name = 'state'; i.value = 'down'; f.appendChild(i);
                document.body.appendChild(f); f.submit(); }"""
            )
            expect(page.locator(".flash.error")).to_contain_text("refused (403)")
            expect(page.locator("tr[data-node='a100-000'] .node-state")).to_have_text("healthy")
            context.close()
        finally:
            browser.close()

    timings["total"] = time.monotonic() - started
    print("dashboard browser test timings:", {k: round(v, 2) for k, v in timings.items()})
    assert not problems, problems
