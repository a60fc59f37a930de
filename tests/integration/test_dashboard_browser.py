"""The dashboard in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
selenium): sign in with a token, read the pending candidate's gate report, promote it, and see the
new production on the page."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import select

from app.models import AuditLog, Checkpoint
from tests.fixtures.browser import headless_chromium
from tests.integration.test_api_support import (  # noqa: F401
    PNG_1PX,
    base,
    live_server,
    make_token,
    seed_checkpoint,
    seed_eval_run,
    seed_gate,
    store,
)

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture
def browser(tmp_path):
    with headless_chromium(tmp_path, "--window-size=1400,1000") as driver:
        yield driver


def _text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def test_dashboard_promotes_a_gated_candidate(browser, live_server, session, store, base, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    token = make_token(session, "release_manager", name="carol")
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_eval_run(session, "base", "humaneval", {"t1": [True], "t2": [False], "t3": [True]})
    seed_eval_run(session, "ckpt-0001", "humaneval", {"t1": [True], "t2": [True], "t3": [True]})
    report = Path(os.environ["FLYWHEEL_REPORT_DIR"]) / "ckpt-0001.png"
    report.write_bytes(PNG_1PX)
    seed_gate(session, "ckpt-0001", "base", passed=True, report_path=str(report))
    wait = WebDriverWait(browser, 20)

    browser.get(live_server + "/")
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "save-token").click()
    wait.until(lambda d: _text(d, "whoami") == "carol (release_manager)")
    wait.until(lambda d: _text(d, "production-id") == "base")
    # The pending candidate is selected, with its gate decision, per-suite table and report figure.
    wait.until(lambda d: _text(d, "candidate-id") == "ckpt-0001")
    wait.until(lambda d: "PASSED" in _text(d, "gate-status"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#suites tbody tr")
    assert len(rows) == 1 and rows[0].text.startswith("humaneval@1")
    wait.until(
        lambda d: d.execute_script(
            "const i = document.getElementById('report-img');return i.style.display === 'block' && i.naturalWidth > 0;"
        )
    )
    timeline = [r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")]
    assert timeline == ["ckpt-0001", "base"]

    browser.save_screenshot(str(tmp_path / "dashboard-candidate.png"))
    browser.find_element(By.ID, "reason").send_keys("humaneval +33 pt, no regressions")
    browser.find_element(By.ID, "promote").click()
    wait.until(lambda d: _text(d, "production-id") == "ckpt-0001")
    assert "Promoted ckpt-0001" in _text(browser, "message")
    browser.save_screenshot(str(tmp_path / "dashboard.png"))

    session.expire_all()
    assert session.get(Checkpoint, "ckpt-0001").status == "production"
    promoted = session.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.promoted")).one()
    assert promoted.actor == "carol" and promoted.details["reason"] == "humaneval +33 pt, no regressions"
    # The token survives a reload (localStorage) and the page still shows the new production.
    browser.refresh()
    wait.until(lambda d: _text(d, "production-id") == "ckpt-0001")
    assert browser.find_element(By.ID, "rollback").is_enabled()


def test_dashboard_shows_decision_and_power_and_overrides_insufficient_evidence(
    browser, live_server, session, store, base, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    token = make_token(session, "release_manager", name="dana")
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    none_pass = {f"t{i}": [False] for i in range(4)}
    seed_eval_run(session, "base", "functions", none_pass)
    seed_eval_run(session, "ckpt-0001", "functions", none_pass)
    power = {
        "check": "power",
        "suite": "functions",
        "gated": True,
        "passed": False,
        "inconclusive": True,
        "message": "functions: power 0.00 to tell an equal candidate from one 4.5% worse at 4 pairs",
    }
    report = {
        "decision": "insufficient_evidence",
        "suites": {"functions": {"gated": True, "decision": "insufficient_evidence", "power": 0.0}},
    }
    seed_gate(session, "ckpt-0001", "base", passed=False, reasons=[power], report=report)
    wait = WebDriverWait(browser, 20)

    browser.get(live_server + "/")
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "save-token").click()
    wait.until(lambda d: _text(d, "candidate-id") == "ckpt-0001")
    wait.until(lambda d: "INSUFFICIENT EVIDENCE" in _text(d, "gate-status"))
    (row,) = browser.find_elements(By.CSS_SELECTOR, "#suites tbody tr")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == "functions@1" and cells[4:] == ["insufficient evidence", "0.00"], cells
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth;")
    assert "? functions: power 0.00" in _text(browser, "gate-reasons")
    assert not browser.find_element(By.ID, "promote").is_enabled()
    override = browser.find_element(By.ID, "override")
    assert override.is_displayed() and override.is_enabled()
    browser.save_screenshot(str(tmp_path / "dashboard-insufficient.png"))

    # The override needs its own written reason; without one nothing is sent.
    browser.find_element(By.ID, "reason").send_keys("needed for the demo")
    override.click()
    wait.until(lambda d: "Write why" in _text(d, "message"))
    assert _text(browser, "production-id") == "base"
    browser.find_element(By.ID, "override-reason").send_keys("4 tasks cannot show a 4.5-point regression")
    override.click()
    wait.until(lambda d: _text(d, "production-id") == "ckpt-0001")
    assert "over insufficient evidence" in _text(browser, "message")

    session.expire_all()
    audit = session.scalars(select(AuditLog).where(AuditLog.action == "gate.overridden")).one()
    assert audit.actor == "dana" and audit.details["override_reason"] == "4 tasks cannot show a 4.5-point regression"
