"""``quiver serve --docs``: the interactive ``/docs`` and ``/redoc`` pages render offline
(issue 32).

Every script, stylesheet and icon the pages reference is served by the app itself, from the
packaged Swagger UI and ReDoc (the ``serve-docs`` extra); no URL in a page names another host.
Without the extra, ``--docs`` is refused at start-up with one line naming it.
"""

import re
import sys
from html.parser import HTMLParser

import httpx
import pytest

from quiver.cli import main as quiver_main
from quiver.serving import Engine, ServeConfig
from quiver.serving.app import create_app
from quiver.serving.http import HTTPThread

pytest.importorskip("fastapi_offline", reason="the serve-docs extra is not installed")


class _Assets(HTMLParser):
    """The URLs a page loads: ``<script src>`` and ``<link href>``."""

    def __init__(self):
        super().__init__()
        self.scripts: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.links.append(attrs["href"])


@pytest.fixture
def docs_server(world):
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig(docs=True))
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    yield http
    http.stop()
    eng.stop()


_HOST = re.compile(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", re.I)


def _page_assets(url: str, path: str) -> tuple[str, _Assets]:
    """GET ``path``: its HTML, after checking every script and stylesheet it loads is served
    (200, non-empty) from this server's own paths and no URL in it names another host."""
    r = httpx.get(url + path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    # no other host anywhere in the page: not in an attribute, not in the inline script
    assert not _HOST.search(html), html
    page = _Assets()
    page.feed(html)
    assert page.scripts and page.links, html
    kinds = set()
    for ref in page.scripts + page.links:
        assert ref.startswith("/") and not ref.startswith("//"), ref  # this server's own path
        asset = httpx.get(url + ref)
        assert asset.status_code == 200, (ref, asset.status_code)
        assert len(asset.content) > 0, ref
        kinds.add(asset.headers["content-type"].split(";")[0])
    assert any("javascript" in k for k in kinds), kinds
    return html, page


def test_swagger_ui_loads_every_asset_from_the_server_itself(docs_server):
    url = docs_server.url
    html, page = _page_assets(url, "/docs")
    assert any("css" in httpx.get(url + ref).headers["content-type"] for ref in page.links)
    # the inline script builds the UI from the served bundle over this server's schema
    bundle = httpx.get(url + page.scripts[0]).text
    assert "SwaggerUIBundle" in bundle and "SwaggerUIBundle(" in html
    assert '"validatorUrl": null' in html  # no badge fetched from validator.swagger.io
    (schema_url,) = re.findall(r"url: '([^']+)'", html)
    schema = httpx.get(url + schema_url)
    assert schema.status_code == 200 and "/v1/predict" in schema.json()["paths"]
    # Swagger UI renders OpenAPI 3.1 (FastAPI's schema version) from 5.0 on
    assert schema.json()["openapi"].startswith("3.1")
    version = re.search(r'"(5\.\d+\.\d+)"', bundle)
    assert version is not None, "the served bundle is not Swagger UI 5"


def test_redoc_loads_every_asset_from_the_server_itself(docs_server):
    url = docs_server.url
    html, page = _page_assets(url, "/redoc")
    assert any("Redoc" in httpx.get(url + ref).text[:200000] for ref in page.scripts)
    (spec,) = re.findall(r'spec-url="([^"]+)"', html)
    assert httpx.get(url + spec).status_code == 200


def test_docs_assets_off_without_docs(world):
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig())
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    try:
        for path in ("/docs", "/docs/static/swagger-ui-bundle.js", "/redoc", "/docs/static"):
            assert httpx.get(http.url + path).status_code == 404, path
    finally:
        http.stop()
        eng.stop()


def test_docs_without_the_extra_is_one_line(world, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi_offline", None)  # `import` now fails
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig(docs=True))
    with pytest.raises(ValueError, match=r"serve-docs") as info:
        create_app(eng)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from quiver.datasets import synthetic

    d = tmp_path_factory.mktemp("tiny")
    synthetic("tiny", seed=0, out=d)
    ckpt = d / "ckpt.pt"
    argv = ["train-model", str(d), "--out", str(ckpt), "--epochs", "1", "--fanouts", "5,3"]
    assert quiver_main(argv + ["--batch-size", "32", "--hidden", "16"]) == 0
    return d, ckpt


def test_serve_docs_without_the_extra_fails_at_start_with_one_line(trained, monkeypatch, capsys):
    d, ckpt = trained
    monkeypatch.setitem(sys.modules, "fastapi_offline", None)
    rc = quiver_main(["serve", str(d), "--checkpoint", str(ckpt), "--port", "0", "--docs"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--docs needs the packaged Swagger UI" in err
    assert "pip install 'maestro-quiver[serve-docs]'" in err
