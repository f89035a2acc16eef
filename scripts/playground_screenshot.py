"""Screenshot the browser playground after a real compare run.

    python scripts/playground_screenshot.py BUNDLE -o docs/playground.png [--prompt TEXT]
        [--tau-a 1.0] [--tau-b 0.9] [--draft both] [--max-tokens 96] [--width 1280] [--timeout 600]

Starts ``python -m runtime.serve BUNDLE`` on a free loopback port, opens its page in
headless Chromium (Debian's ``chromium`` and ``chromium-driver`` packages, driven by
Selenium), picks the draft source, sends the prompt in the compare view at the two values
of tau, waits until both answers are done, and saves a PNG of the whole page. The defaults
are the main job's (scripts/demo.sh: tau 1.0 and 0.9, draft source both). The browser tests
(tests/serving/test_playground_browser.py) drive the page with the helpers below.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from runtime.bundle import load_config
from runtime.command_line import ArgumentParser, run_main, tau_value
from runtime.decode.params import DRAFTS

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def find_browser() -> tuple[str, str]:
    """Paths of ``chromium`` and ``chromedriver``.

    Raises:
        FileNotFoundError: one is missing (install the Debian packages chromium and chromium-driver).
    """
    found = {name: shutil.which(name) for name in ("chromium", "chromedriver")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} not found: install them with "
                                "`apt-get install chromium chromium-driver` (Debian)")
    return found["chromium"], found["chromedriver"]


def make_driver(width: int = 1280, height: int = 900) -> webdriver.Chrome:
    """Headless Chromium with a ``width`` x ``height`` CSS-pixel viewport, its console log kept.

    Raises:
        FileNotFoundError: as :func:`find_browser`.
    """
    chromium, chromedriver = find_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # No sandbox: CI runs as root. No background networking, component updates, sync or
    # QUIC: the machine's network is closed, and Chromium would otherwise keep dialling out.
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    set_viewport(driver, width, height)
    return driver


def set_viewport(driver: webdriver.Chrome, width: int, height: int) -> None:
    """Make the page's viewport exactly ``width`` x ``height`` CSS pixels (a phone below 800 wide)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 800})


def set_range(driver: webdriver.Chrome, element_id: str, value: float) -> None:
    """Set a slider's value as a drag would (an ``input`` event follows)."""
    driver.execute_script("const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                          "el.dispatchEvent(new Event('input', {bubbles: true}));", element_id, str(value))


def wait_answers(driver: webdriver.Chrome, css: str, count: int, timeout: float) -> list[WebElement]:
    """The ``count`` answers matching ``css`` once none is still streaming."""
    def done(d):
        answers = d.find_elements(By.CSS_SELECTOR, css)
        is_done = len(answers) == count and all(a.get_attribute("data-state") != "streaming" for a in answers)
        return answers if is_done else False

    return WebDriverWait(driver, timeout).until(done)


def run_compare(driver: webdriver.Chrome, prompt: str, tau_a: float, tau_b: float,
                timeout: float) -> list[WebElement]:
    """In the open page: the compare view, the prompt at ``tau_a`` and ``tau_b``; the two answers when done."""
    driver.find_element(By.ID, "tab-compare").click()
    set_range(driver, "tau-a", tau_a)
    set_range(driver, "tau-b", tau_b)
    box = driver.find_element(By.ID, "compare-prompt")
    box.clear()
    box.send_keys(prompt)
    driver.find_element(By.ID, "compare-run").click()
    answers = wait_answers(driver, ".pane .answer", 2, timeout)
    WebDriverWait(driver, timeout).until(expected_conditions.element_to_be_clickable((By.ID, "compare-run")))
    return answers


def start_server(bundle: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """``python -m runtime.serve BUNDLE`` on a free loopback port; (process, base URL) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "runtime.serve", bundle, "--port", str(port),
                               "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the server did not start (exit status {server.poll()})")
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", help="bundle directory to serve")
    p.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    p.add_argument("--prompt", default=PROMPT, help="the compare prompt (default: a GSM8K question)")
    p.add_argument("--tau-a", type=tau_value, default=1.0, help="tau of the left answer (default 1.0)")
    p.add_argument("--tau-b", type=tau_value, default=0.9, help="tau of the right answer (default 0.9)")
    p.add_argument("--draft", choices=DRAFTS, default="both",
                   help="the page's draft source (default both)")
    p.add_argument("--max-tokens", type=int, default=96, help="max tokens of each answer (default 96)")
    p.add_argument("--width", type=int, default=1280, help="viewport width in CSS pixels (default 1280)")
    p.add_argument("--timeout", type=float, default=600, help="longest wait for the server or an answer (s)")
    args = p.parse_args(argv)
    load_config(args.bundle)  # a path that is no bundle: one error line (run_main), not a server that did not start
    server, url = start_server(args.bundle, args.timeout)
    driver = make_driver(args.width)
    try:
        driver.get(url)
        max_tokens = driver.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys(str(args.max_tokens))
        Select(driver.find_element(By.ID, "draft")).select_by_value(args.draft)
        answers = run_compare(driver, args.prompt, args.tau_a, args.tau_b, args.timeout)
        errors = [a.text for a in answers if a.get_attribute("data-state") == "error"]
        if errors:
            print(f"error: an answer failed: {errors[0]}", file=sys.stderr)
            return 1
        WebDriverWait(driver, args.timeout).until(  # the status line refreshed after the run (every 3 s)
            lambda d: "queue 0 · slots 0/" in d.find_element(By.ID, "server-status").text)
        height = driver.execute_script(  # the page's content, however long the answers
            "return Math.ceil(document.querySelector('main').getBoundingClientRect().bottom) + 12")
        set_viewport(driver, args.width, height)
        driver.execute_script("window.scrollTo(0, 0)")  # streaming scrolled the answers into view
        args.output.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.output))
    finally:
        driver.quit()
        server.terminate()
        server.wait(timeout=60)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
