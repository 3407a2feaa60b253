"""The chat page at / in a real headless browser (Debian's chromium, driven by selenium through
chromium-driver): it asks for the key, streams an answer equal to the API's, keeps the
conversation, renders markdown safely, and stops an answer mid-stream.  It skips, saying why,
where no browser is installed (.ci/run installs one)."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import HTTPServer

KEY = "open-sesame"
QUESTION = "Name the capital of France."


def browser_or_skip():
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no chromium and chromium-driver here (apt-get install chromium chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = HTTPServer("-m", "smollm2", "-c", "1024", "-np", "2", "--api-key", KEY,
                   log_path=tmp_path_factory.mktemp("http") / "page.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    driver = browser_or_skip()
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def api_answer(server, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def set_field(browser, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    field = browser.find_element(By.ID, name)
    field.clear()
    field.send_keys(value)


def ask(browser, text: str, timeout: float = 120):
    """Type ``text``, send it, and wait for the answer to end; its element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    set_field(browser, "input", text)
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, timeout).until(
        lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before
        and b.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("data-done") is not None)
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def test_the_page_asks_for_the_key_and_streams_the_apis_answer(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    page = httpx.get(server.url + "/", timeout=30)  # the page itself needs no key; its API calls do
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "src=" not in page.text and "<link" not in page.text and "@import" not in page.text  # nothing from a CDN
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "keyform").is_displayed())
    set_field(browser, "key", KEY)
    browser.find_element(By.ID, "key-save").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text.endswith(".gguf"))
    browser.find_element(By.ID, "toggle-settings").click()
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "24")
    first = ask(browser, QUESTION)
    want = api_answer(server, [{"role": "user", "content": QUESTION}], 24)
    assert first.get_attribute("data-done") == "1" and first.get_attribute("data-raw") == want
    assert first.text.strip() and "tokens/s" in browser.find_element(By.ID, "speed").text
    # the conversation is kept: the second question is answered after the first exchange
    second = ask(browser, "And of Italy?")
    want = api_answer(server, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": want},
                               {"role": "user", "content": "And of Italy?"}], 24)
    assert second.get_attribute("data-raw") == want
    shot = Path(tmp_path) / "chat-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_markdown_is_rendered_and_nothing_in_an_answer_runs(server, browser):
    browser.get(server.url + "/")
    html = browser.execute_script(
        "return renderMarkdown(arguments[0]);",
        "# Title\n**bold** and *it* and `x<1`\n\n- one\n- two\n\n```python\nif a < b:\n    print('<b>')\n```\n"
        "<img src=x onerror=alert(1)> [link](https://example.org) [bad](javascript:alert(1))")
    assert "<h3>Title</h3>" in html and "<strong>bold</strong>" in html and "<em>it</em>" in html
    assert "<code>x&lt;1</code>" in html and "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre><code data-lang="python">if a &lt; b:\n    print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "<img" not in html and "&lt;img" in html and 'href="https://example.org"' in html
    assert "javascript:" not in html.split("[bad]")[0] and 'href="javascript' not in html


def test_the_stop_button_ends_an_answer_and_the_server_goes_on(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(server.url + "/")  # the key is kept for the tab
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text.endswith(".gguf"))
    browser.find_element(By.ID, "toggle-settings").click()
    set_field(browser, "max_tokens", "400")
    set_field(browser, "input", "Write a very long story about a lighthouse.")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 60).until(
        lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1
        and len(b.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-raw")) > 20)
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-done") is not None)
    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant")
    assert answer.get_attribute("data-stopped") == "1" and int(answer.get_attribute("data-tokens")) < 400
    assert api_answer(server, [{"role": "user", "content": QUESTION}], 4)  # still serving
