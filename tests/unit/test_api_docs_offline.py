"""``/docs`` and ``/redoc`` work on a host without internet: their pages reference only this
server's own paths, and the server serves every asset they reference (the rendering with the
network off is in ``tests/integration/test_api_docs_browser.py``)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app


class _Assets(HTMLParser):
    """Every ``src`` and ``href`` of a page, and the URLs its inline script names."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app()) as c:
        yield c


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_only_assets_this_server_serves(client, page):
    res = client.get(page)
    assert res.status_code == 200
    html = res.text
    assert "cdn." not in html and "googleapis" not in html and "https://" not in html
    parser = _Assets()
    parser.feed(html)
    assert len(parser.urls) >= 2, parser.urls  # the script and the stylesheet or favicon
    for url in parser.urls:
        assert url.startswith("/"), f"{page} loads {url} from elsewhere"
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
    spec = client.get("/openapi.json")
    assert spec.status_code == 200 and spec.json()["info"]["title"] == "flywheel promotion API"
