"""The playground over HTTP (no browser): its files are served, shipped in the wheel, and off with --no-ui.

The browser tests are in test_playground_browser.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from fastapi.testclient import TestClient

from runtime.serve import build_app, parse_args
from runtime.serving.playground import STATIC_DIR

REPO = Path(__file__).resolve().parents[2]
STATIC_FILES = sorted(p.name for p in STATIC_DIR.iterdir())


def test_the_page_and_its_files_are_served(tiny_server):
    page = tiny_server.http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    linked = re.findall(r'(?:src|href)="(/[^"]*)"', page.text)
    assert sorted(linked) == ["/static/playground.css", "/static/playground.js"]
    for path, kind in zip(sorted(linked), ("text/css", "text/javascript")):
        r = tiny_server.http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
    r = tiny_server.http.get("/static/missing.js")
    assert r.status_code == 404 and "error" in r.json()


def test_the_page_fetches_nothing_but_our_routes():
    """No CDN, no other host: every URL in the files is one of the server's own paths."""
    routes = {"/v1/chat/completions", "/metrics", "/health", "/static/playground.css", "/static/playground.js"}
    for name in STATIC_FILES:
        text = (STATIC_DIR / name).read_text()
        assert "://" not in text, name
        assert set(re.findall(r'["(](/[a-z][\w/.]*)[")]', text)) <= routes, name


def test_no_ui_leaves_the_page_out(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    with_ui, without_ui = (TestClient(build_app(parse_args([str(bundle), *flags]))) for flags in ([], ["--no-ui"]))
    assert with_ui.get("/").status_code == 200  # no lifespan: the engine thread never starts
    for path in ("/", "/static/playground.js"):
        r = without_ui.get(path)
        assert r.status_code == 404 and "error" in r.json(), path


def test_the_wheel_ships_the_page(tmp_path):
    """A non-editable install has the page: the files are package data of the wheel.

    Built from a copy of the checkout's files (tracked, and untracked but not ignored, as
    they are now), because a build writes build/ and *.egg-info into its source tree.
    """
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    source = tmp_path / "source"
    for name in filter(None, listed):
        if (REPO / name).is_file():  # not a tracked file deleted in the working tree
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("mars_edge-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"runtime/serving/static/{name}" for name in STATIC_FILES} <= names
    assert STATIC_FILES == ["index.html", "playground.css", "playground.js"]
