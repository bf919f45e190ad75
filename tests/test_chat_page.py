"""The chat page at GET /, in a real headless browser (Chromium through selenium): the
server on the bundled model, two turns typed into the page. Skipped where no browser
or driver is installed (Debian: ``apt-get install chromium chromium-driver``, then
``pip install selenium``)."""
from __future__ import annotations

import shutil
import time

import pytest

from test_server import running

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")

BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(BROWSER is None or DRIVER is None,
                                reason="no Chromium and chromedriver (apt-get install chromium chromium-driver)")

#: forced into the reasoning when its budget runs out, so that the reasoning streamed
#: by the server holds a code block (with markup that must stay text) and is followed
#: by an answer within a few tokens
BUDGET_MESSAGE = '\nA sketch:\n```python\nprint("<b>bold</b>")\n```\n'

#: a second turn with a code block of its own, markup and a script-carrying tag in it
SECOND_TURN = ("Why does this fail?\n```python\nitems = [3, 1, 2]\nitems.sort(key=<lambda>)\n"
               "<img src=x onerror=\"window.injected = 1\">\n```\nand `sorted` too?")

#: the state of the last assistant message, recorded in the page at every change
WATCH = """
window.states = [];
new MutationObserver(() => {
  const boxes = document.querySelectorAll('.msg.assistant'), box = boxes[boxes.length - 1];
  if (!box) return;
  const d = box.querySelector('details.reasoning'), a = box.querySelector('.answer');
  window.states.push({turn: boxes.length, open: d ? d.open : null,
                      thought: d ? d.textContent.length - d.querySelector('summary').textContent.length : 0,
                      answer: a ? a.textContent.length : 0});
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true, attributes: true});
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no -m: the bundled model; greedy (--temp 0), so each turn's text is the same every run
    with running(["--spec-type", "draft-mtp", "-c", "4096", "-np", "1", "-t", "1", "--temp", "0",
                  "--reasoning-budget", "24", "--reasoning-budget-message", BUDGET_MESSAGE],
                 tmp_path_factory.mktemp("chat-page")) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,900"):
        opts.add_argument(arg)
    from selenium.common.exceptions import WebDriverException

    try:
        drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    except WebDriverException as e:  # installed but unable to run here (no display libraries, ...)
        pytest.skip(f"Chromium did not start: {e.msg}")
    try:
        yield drv
    finally:
        drv.quit()


def _wait(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _send(drv, text: str, turn: int) -> None:
    drv.execute_script("const i = document.getElementById('input'); i.value = arguments[0];"
                       "document.getElementById('form').requestSubmit();", text)
    _wait(lambda: len(drv.find_elements("css selector", ".stats")) >= turn, what=f"turn {turn}'s end")


def test_two_turns(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    drv = browser
    drv.get(server.url + "/")
    _wait(lambda: drv.find_element(By.ID, "model").text, what="the model's name")
    # the model's name, not the path the API calls it by
    model = drv.find_element(By.ID, "model")
    assert model.text == "stdlib-q8_0" and model.get_attribute("title").endswith("/stdlib-q8_0.gguf")
    drv.execute_script(WATCH)
    drv.find_element(By.ID, "max").clear()
    drv.find_element(By.ID, "max").send_keys("64")

    _send(drv, "Write a function that reverses a list.", 1)
    _send(drv, SECOND_TURN, 2)
    drv.save_screenshot(str(tmp_path / "chat.png"))

    states = drv.execute_script("return window.states")
    for turn in (1, 2):
        mine = [s for s in states if s["turn"] == turn]
        # the reasoning is shown while it streams, before any answer
        assert any(s["open"] and s["thought"] > 0 and s["answer"] == 0 for s in mine), mine
        # and folded from the answer's first token on
        assert any(s["answer"] > 0 for s in mine), mine
        assert all(s["open"] is False for s in mine if s["answer"] > 0), mine

    boxes = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    assert len(boxes) == 2
    for box in boxes:
        details = box.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert details.get_attribute("open") is None and box.find_element(By.CSS_SELECTOR, ".answer").text
        # the code block the server forced into the reasoning, its markup as text
        code = details.find_element(By.CSS_SELECTOR, "pre > code.language-python")
        assert code.get_attribute("textContent") == 'print("<b>bold</b>")'
    # the second turn's own code block: one code element, markup kept as text, nothing run
    user = drv.find_elements(By.CSS_SELECTOR, ".msg.user")[1]
    code = user.find_element(By.CSS_SELECTOR, "pre > code.language-python")
    assert code.get_attribute("textContent") == ("items = [3, 1, 2]\nitems.sort(key=<lambda>)\n"
                                                 "<img src=x onerror=\"window.injected = 1\">")
    assert [c.text for c in user.find_elements(By.CSS_SELECTOR, ".prose code")] == ["sorted"]
    assert not drv.find_elements(By.CSS_SELECTOR, "#log img, #log b, #log lambda")
    assert drv.execute_script("return window.injected") is None
    # the second request carried the whole conversation, reasoning included
    history = drv.execute_script("return messages")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert "```python" in history[1]["reasoning_content"] and history[1]["content"]
    stats = drv.find_elements(By.CSS_SELECTOR, ".stats")
    assert all("tokens" in s.text and "drafts accepted" in s.text for s in stats)
    assert (tmp_path / "chat.png").stat().st_size > 10_000
