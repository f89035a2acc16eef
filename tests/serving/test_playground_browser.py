"""Tier 2 in a real browser: the playground page in headless Chromium (Selenium) against the
tiny random Llama (B = W = 4) served on loopback with an API key (and once on the block scheme).

Every wait is on a DOM condition (an answer's ``data-state`` leaves ``streaming``, a text
appears), never on a sleep. The engine is greedy, so the page's answers are compared with
the API's. Skipped only where chromium or chromedriver is missing (.ci/run installs them).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait
from server_support import DEADLINE_S, serve
from support import load_script

ROOT = Path(__file__).resolve().parents[2]
screenshot = load_script(ROOT / "scripts" / "playground_screenshot.py")
try:
    screenshot.find_browser()
    BROWSER_MISSING = None
except FileNotFoundError as e:
    BROWSER_MISSING = str(e)
pytestmark = pytest.mark.skipif(BROWSER_MISSING is not None, reason=f"no browser: {BROWSER_MISSING}")

KEY = "playground-key"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tiny_bundle):
    """The tiny model served with an API key (the continuous scheme, the default)."""
    _, bundle = tiny_bundle("llama", 4)
    with serve_recorded(str(bundle), "--api-key", KEY, "--tau-min", "0.5") as running:
        yield running


@contextmanager
def serve_recorded(*argv: str):
    """``python -m runtime.serve ARGV`` (:func:`server_support.serve`); ``server.sent`` collects each request's
    DecodeParams, ``server.prompts`` its prompt ids."""
    sent, prompts = [], []

    def record(app):
        loop = app.state.ctx.engine_thread

        def submit(submission, submit=loop.submit):
            sent.append(submission.params)
            prompts.append(submission.prompt_ids)
            submit(submission)

        loop.submit = submit

    with serve(*argv, prepare=record) as running:
        running.sent, running.prompts = sent, prompts
        yield running


@pytest.fixture(scope="module")
def driver():
    driver = screenshot.make_driver()
    yield driver
    driver.quit()


@pytest.fixture
def page(driver, server):
    """The page, freshly loaded, with the key and max tokens entered and the server's state shown
    (draft source: the page's default, both)."""
    screenshot.set_viewport(driver, 1280, 900)
    driver.get_log("browser")  # drops what earlier tests logged
    driver.get(server.url)
    wait(driver, lambda d: "default tau 1.00" in d.find_element(By.ID, "server-status").text)
    wait(driver, lambda d: d.find_element(By.ID, "block-size").get_attribute("value") == "4")
    type_into(driver, "api-key", KEY)
    type_into(driver, "max-tokens", str(MAX_TOKENS))
    return driver


def wait(driver, condition):
    return WebDriverWait(driver, DEADLINE_S).until(condition)


def type_into(driver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def choose(driver, select_id: str, value: str) -> None:
    Select(driver.find_element(By.ID, select_id)).select_by_value(value)


def text_of(element) -> str:
    """The exact text (textContent: every character as the server sent it, unrendered)."""
    return element.get_attribute("textContent")


def chat_in_page(driver, prompt: str):
    """Send ``prompt`` in a new chat; the answer element once it is done (or failed)."""
    driver.find_element(By.ID, "clear").click()
    type_into(driver, "prompt", prompt)
    driver.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    return screenshot.wait_answers(driver, "#transcript .answer", 1, DEADLINE_S)[0]


def step_counts(answer) -> list[int]:
    """The tokens accepted by each forward, from the answer's shaded spans (``data-tokens="3+1"``)."""
    return [int(n) for span in answer.find_elements(By.CSS_SELECTOR, ".text .step")
            for n in span.get_attribute("data-tokens").split("+")]


def api_chat(server, prompt: str, tau: float, draft: str):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=MAX_TOKENS, extra_body={"tau": tau, "draft": draft})
    return r.choices[0].message.content, r.mars


def test_the_page_loads_without_console_errors(page):
    assert page.title == "mars-edge playground"
    assert page.find_element(By.ID, "model-name").text == "bundle"
    assert [o.get_attribute("value") for o in page.find_elements(By.CSS_SELECTOR, "#block-size option")] == \
        ["1", "2", "3", "4"]
    errors = [entry for entry in page.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []


def test_the_header_follows_the_server_default_tau(page, server):
    """An admin change of the base tau reaches the header at its next /metrics refresh."""
    auth = {"Authorization": f"Bearer {KEY}"}
    assert server.http.post("/admin/tau", json={"tau": 0.8}, headers=auth).status_code == 200
    try:
        wait(page, lambda d: "default tau 0.80 (base 0.80)" in d.find_element(By.ID, "server-status").text)
    finally:
        server.http.post("/admin/tau", json={"tau": 1.0}, headers=auth)


def test_a_chat_streams_the_api_answer_at_tau_one(page, server):
    choose(page, "draft", "masks")
    answer = chat_in_page(page, "Hi")
    expected, mars = api_chat(server, "Hi", 1.0, "masks")
    assert answer.get_attribute("data-state") == "done"
    assert text_of(answer.find_element(By.CLASS_NAME, "text")) == expected
    counts = step_counts(answer)
    assert len(counts) > 1 and set(counts) == {1}  # streamed in many chunks; one token per forward
    assert answer.find_element(By.CLASS_NAME, "tpf").text == "1.00" == f"{mars['tpf']:.2f}"
    assert answer.find_element(By.CLASS_NAME, "tokens").text == f"{MAX_TOKENS} / {mars['num_forwards']}"
    assert answer.find_element(By.CLASS_NAME, "ttft").text.endswith(" ms")


def test_moving_the_slider_changes_the_tau_sent(page, server):
    slider = page.find_element(By.ID, "tau")
    slider.click()  # the middle of 0..1
    slider.send_keys(Keys.END, *[Keys.ARROW_LEFT] * 6)
    assert page.find_element(By.ID, "tau-value").text == "0.70"
    answer = chat_in_page(page, "Hi")
    assert server.sent[-1].tau == pytest.approx(0.7)
    expected, mars = api_chat(server, "Hi", 0.7, "both")
    assert text_of(answer.find_element(By.CLASS_NAME, "text")) == expected
    assert answer.find_element(By.CLASS_NAME, "tpf").text == f"{mars['tpf']:.2f}" != "1.00"
    counts = step_counts(answer)
    assert max(counts) > 1 and sum(counts) <= MAX_TOKENS  # multi-token forwards are shaded as such
    shaded = answer.find_elements(By.CSS_SELECTOR, '.text .step:not([data-level="1"])')
    assert shaded and shaded[0].value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"


def test_the_chat_tau_follows_the_server_default_until_the_slider_moves(page, server):
    """Following (the start): the slider shows the server's default tau and requests send no tau, so
    the server's live default applies; moving the slider sends its value, whatever the server's default."""
    follow, slider, shown = (page.find_element(By.ID, name) for name in ("tau-follow", "tau", "tau-value"))
    assert follow.is_selected() and shown.text == "1.00"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert server.http.post("/admin/tau", json={"tau": 0.9}, headers=auth).status_code == 200
    try:
        wait(page, lambda d: shown.text == "0.90")
        assert slider.get_property("value") == "0.9"
        answer = chat_in_page(page, "Hi")
        assert server.sent[-1].tau is None
        assert answer.find_element(By.CLASS_NAME, "sent").text == "tau server default, threshold, draft both, B 4"
        expected, _ = api_chat(server, "Hi", 0.9, "both")
        assert text_of(answer.find_element(By.CLASS_NAME, "text")) == expected
        slider.send_keys(Keys.END)  # the user's tau from now on
        assert not follow.is_selected() and shown.text == "1.00"
        chat_in_page(page, "Hi")
        assert server.sent[-1].tau == 1.0
        assert server.http.post("/admin/tau", json={"tau": 0.8}, headers=auth).status_code == 200
        wait(page, lambda d: "default tau 0.80" in d.find_element(By.ID, "server-status").text)
        assert shown.text == "1.00"  # not followed any more
        follow.click()
        assert shown.text == "0.80" and slider.get_property("value") == "0.8"
    finally:
        server.http.post("/admin/tau", json={"tau": 1.0}, headers=auth)


def test_the_sliders_reach_a_server_tau_below_one_half(driver, tiny_bundle):
    """A server started at --tau 0.3: the chat slider shows its default tau where it is (it was parked at 0.5, the
    sliders' old lower end). Each slider spans the taus a request may set, 0..1 (the server takes any request tau)."""
    _, bundle = tiny_bundle("llama", 4)
    with serve_recorded(str(bundle), "--tau", "0.3") as low_server:
        driver.get(low_server.url)
        wait(driver, lambda d: "default tau 0.30 (base 0.30)" in d.find_element(By.ID, "server-status").text)
        assert driver.find_element(By.ID, "tau-value").text == "0.30"
        assert driver.find_element(By.ID, "tau").get_property("value") == "0.3"
        for name in ("tau", "tau-a", "tau-b"):
            slider = driver.find_element(By.ID, name)
            assert (slider.get_attribute("min"), slider.get_attribute("max")) == ("0", "1"), name


def test_new_chat_aborts_the_answer_streaming(page, server):
    """New chat while an answer streams: the fetch is aborted (the server counts the request aborted
    and frees its KV slot), Send works at once and the next prompt starts an empty conversation.
    The engine waits at the test gate, so the answer is still streaming when New chat is clicked."""
    gate = server.gate
    aborted = server.metric('mars_requests_total{outcome="aborted"}')
    type_into(page, "max-tokens", "300")

    def advanced_until(condition):  # one more forward each time the condition is not met yet
        def check(driver):
            if condition(driver):
                return True
            if gate.is_holding():
                gate.allow(1)
            return False
        return check

    with gate.closed():
        type_into(page, "prompt", "Write a long story about a dragon.")
        page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
        wait(page, advanced_until(lambda d: d.find_elements(By.CSS_SELECTOR, "#transcript .answer .text .step")))
        assert not page.find_element(By.ID, "send").is_enabled()
        page.find_element(By.ID, "clear").click()
        assert page.find_element(By.ID, "send").is_enabled()
        assert page.find_elements(By.CSS_SELECTOR, "#transcript > *") == []
        wait(page, advanced_until(lambda d: server.metric('mars_requests_total{outcome="aborted"}') > aborted))
    assert server.wait_idle()["active_slots"] == 0
    type_into(page, "prompt", "And 2+2?")
    page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
    answer = screenshot.wait_answers(page, "#transcript .answer", 1, DEADLINE_S)[0]
    assert answer.get_attribute("data-state") == "done"
    tokenizer = server.app.state.ctx.tokenizer
    assert server.prompts[-1] == tokenizer.encode_chat([{"role": "user", "content": "And 2+2?"}])
    assert [e.text for e in page.find_elements(By.CSS_SELECTOR, "#transcript .user")] == ["And 2+2?"]


def test_enter_while_an_ime_composes_does_not_send(page, server):
    """Enter that confirms an IME composition (keydown with isComposing) is the IME's, not a send."""
    num_sent = len(server.sent)
    type_into(page, "prompt", "nihon")
    page.execute_script("""document.getElementById('prompt').dispatchEvent(new KeyboardEvent('keydown',
        {key: 'Enter', isComposing: true, bubbles: true, cancelable: true}));""")
    assert page.find_elements(By.CSS_SELECTOR, "#transcript > *") == []
    assert page.find_element(By.ID, "prompt").get_property("value") == "nihon"
    page.find_element(By.ID, "prompt").send_keys(Keys.ENTER)  # composition over: Enter sends
    answer = screenshot.wait_answers(page, "#transcript .answer", 1, DEADLINE_S)[0]
    assert answer.get_attribute("data-state") == "done" and len(server.sent) == num_sent + 1


def test_the_compare_view_shows_two_answers_with_their_tpf(page, server):
    num_sent = len(server.sent)
    answers = screenshot.run_compare(page, "Hi", 1.0, 0.5, DEADLINE_S)
    assert [params.tau for params in server.sent[num_sent:]] == [1.0, 0.5]
    for answer, tau in zip(answers, (1.0, 0.5)):
        expected, mars = api_chat(server, "Hi", tau, "both")
        assert answer.get_attribute("data-state") == "done"
        assert answer.find_element(By.CLASS_NAME, "answer-label").text.endswith(f"tau {tau:.2f}")
        assert text_of(answer.find_element(By.CLASS_NAME, "text")) == expected
        assert answer.find_element(By.CLASS_NAME, "tpf").text == f"{mars['tpf']:.2f}"


def test_the_draft_sent_follows_the_select(page, server):
    """Both by default (the main job's); at tau 1 its answer is the greedy AR text of plain MARS."""
    assert page.find_element(By.ID, "draft").get_attribute("value") == "both"
    texts = set()
    for draft in ("both", "lookup", "masks"):
        choose(page, "draft", draft)
        answer = chat_in_page(page, "Hi Hi Hi Hi Hi Hi")
        assert server.sent[-1].draft == draft and server.sent[-1].tau is None  # the server's default, 1
        expected, mars = api_chat(server, "Hi Hi Hi Hi Hi Hi", 1.0, draft)
        text = text_of(answer.find_element(By.CLASS_NAME, "text"))
        assert text == expected
        texts.add(text)
        assert answer.find_element(By.CLASS_NAME, "tpf").text == f"{mars['tpf']:.2f}"
        assert answer.find_element(By.CLASS_NAME, "sent").text == f"tau server default, threshold, draft {draft}, B 4"
    assert len(texts) == 1  # lossless at tau 1 whatever the draft source


def test_the_adaptive_masks_box_is_sent(page, server):
    """Off by default (the field is not sent); ticked, the request asks for adaptive masks and the answer says so.
    The continuous scheme runs them (/health: no reason why not), so the box is enabled, with its plain hint."""
    box, note = page.find_element(By.ID, "adaptive-masks"), page.find_element(By.ID, "adaptive-masks-note")
    assert server.health()["why_no_adaptive_masks"] is None
    assert box.is_enabled() and not box.is_selected() and adaptive_masks_label(page).get_attribute("title") == ""
    assert note.text.startswith("Feed mask tokens only while they gain tokens") and "blocked" not in \
        note.get_attribute("class")
    chat_in_page(page, "Hi")
    assert server.sent[-1].adaptive_masks is False
    page.find_element(By.ID, "adaptive-masks").click()
    answer = chat_in_page(page, "Hi")
    assert server.sent[-1].adaptive_masks is True
    assert answer.find_element(By.CLASS_NAME, "sent").text == ("tau server default, threshold, draft both, adaptive masks"
                                                               ", B 4")


def test_the_adaptive_masks_box_is_disabled_with_the_reason_on_the_block_scheme(driver, tiny_bundle):
    """The block scheme runs every step W wide, so the server refuses adaptive masks (a 400); /health says why
    beforehand, and the page disables the box with that same reason under it and as its tooltip. Clicking it
    changes nothing, and a chat is sent without the field and answered."""
    _, bundle = tiny_bundle("llama", 4)
    with serve_recorded(str(bundle), "--scheme", "block") as block_server:
        why = block_server.health()["why_no_adaptive_masks"]
        assert why.startswith("adaptive masks cannot act here") and "--scheme continuous" in why
        driver.get(block_server.url)
        wait(driver, lambda d: d.find_element(By.ID, "block-size").get_attribute("value") == "4")
        box, note = driver.find_element(By.ID, "adaptive-masks"), driver.find_element(By.ID, "adaptive-masks-note")
        assert not box.is_enabled() and not box.is_selected()
        assert note.text == why == adaptive_masks_label(driver).get_attribute("title")
        assert note.value_of_css_property("color") == "rgba(138, 75, 0, 1)"  # as a refused draft source's note
        adaptive_masks_label(driver).click()
        assert not box.is_selected()
        type_into(driver, "max-tokens", str(MAX_TOKENS))
        answer = chat_in_page(driver, "Hi")
        assert answer.get_attribute("data-state") == "done"
        assert block_server.sent[-1].adaptive_masks is False
        assert "adaptive masks" not in answer.find_element(By.CLASS_NAME, "sent").text


def adaptive_masks_label(driver):
    return driver.find_element(By.XPATH, "//input[@id='adaptive-masks']/parent::label")


@pytest.mark.parametrize("blocker", ["temperature", "mode ar"])
def test_a_refused_draft_source_is_prevented_and_explained(page, server, blocker):
    """Lookup drafts with a sampling temperature or in AR mode would be a 400: the page sends masks,
    shows it in the disabled select with a note saying why, and gives the choice back after."""
    draft = page.find_element(By.ID, "draft")
    note = page.find_element(By.ID, "draft-note")
    choose(page, "draft", "lookup")
    if blocker == "temperature":
        type_into(page, "temperature", "0.7")
        reason = "Lookup drafts are greedy only, so at temperature 0.7 masks only is sent"
    else:
        choose(page, "mode", "ar")
        reason = "Mode AR feeds no drafts, so masks only is sent"
    assert not draft.is_enabled() and draft.get_attribute("value") == "masks"
    assert note.text.startswith(reason) and note.value_of_css_property("color") == "rgba(138, 75, 0, 1)"
    answer = chat_in_page(page, "Hi")
    assert answer.get_attribute("data-state") == "done"
    assert server.sent[-1].draft == "masks"
    assert (server.sent[-1].temperature, server.sent[-1].mode) == ((0.7, "threshold") if blocker == "temperature"
                                                                   else (0.0, "ar"))
    if blocker == "temperature":
        type_into(page, "temperature", "0")
    else:
        choose(page, "mode", "threshold")
    assert draft.is_enabled() and draft.get_attribute("value") == "lookup"
    assert note.text.startswith("Prompt-lookup drafts")


def test_server_errors_read_as_messages(page):
    choose(page, "mode", "verify")
    type_into(page, "temperature", "0.7")
    answer = chat_in_page(page, "Hi")
    assert answer.get_attribute("data-state") == "error"
    message = answer.find_element(By.CLASS_NAME, "error").text
    assert message.startswith("400: ") and "verify mode is greedy only" in message
    type_into(page, "temperature", "0")
    page.find_element(By.ID, "api-key").clear()
    answer = chat_in_page(page, "Hi")
    assert answer.find_element(By.CLASS_NAME, "error").text.startswith("401: missing or wrong API key")
    type_into(page, "api-key", KEY)
    page.refresh()  # the key is kept in the browser
    assert wait(page, lambda d: d.find_element(By.ID, "api-key").get_attribute("value")) == KEY


@pytest.mark.parametrize("width", [1280, 390])
def test_readable_without_horizontal_overflow(page, width):
    """After a compare run and a chat, at a laptop's and a phone's width: nothing is wider than the
    viewport, and the two answers sit side by side only where there is room."""
    answers = screenshot.run_compare(page, "Hi " * 20, 1.0, 0.5, DEADLINE_S)
    screenshot.set_viewport(page, width, 900)
    overflow = page.execute_script("""
        const width = document.documentElement.clientWidth;
        const wide = [...document.querySelectorAll('body *')].filter(el => {
            const r = el.getBoundingClientRect();
            return r.width > 0 && (r.left < -0.5 || r.right > width + 0.5);
        });
        return [document.documentElement.scrollWidth - width, wide.map(el => el.id || el.className)];""")
    assert overflow == [0, []]
    a, b = (answer.rect for answer in answers)
    assert (a["y"] == b["y"]) == (width >= 800)
    assert page.execute_script("return parseFloat(getComputedStyle(document.body).fontSize)") >= 16
