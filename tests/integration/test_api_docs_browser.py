"""``/docs`` renders in headless Chromium with every host but the API's own loopback unreachable
(``--host-resolver-rules`` resolves no name but 127.0.0.1, so a CDN cannot answer): Swagger UI draws the
API's title and its operations from assets the server itself serves."""

from __future__ import annotations

import pytest

from tests.fixtures.browser import headless_chromium
from tests.integration.test_api_support import live_server  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture
def offline_browser(tmp_path):
    with headless_chromium(
        tmp_path,
        # No name resolves and no proxy is used: only the literal 127.0.0.1 of the live server answers.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--no-proxy-server",
    ) as driver:
        yield driver


def test_swagger_ui_renders_with_the_network_off(offline_browser, live_server):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    offline_browser.get(live_server + "/docs")
    wait = WebDriverWait(offline_browser, 20)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title"))
    assert "flywheel promotion API" in offline_browser.find_element(By.CSS_SELECTOR, ".info .title").text
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock"))
    paths = {e.text for e in offline_browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert any(p.startswith("/v1/checkpoints") for p in paths), paths

    # The CDN that FastAPI's stock page would load from is out of reach in this browser.
    from selenium.common.exceptions import WebDriverException

    with pytest.raises(WebDriverException, match="ERR_NAME_NOT_RESOLVED"):
        offline_browser.get("https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css")
