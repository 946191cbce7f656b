"""The chat page at ``/`` in a real browser (headless Chromium from Debian's ``chromium`` and ``chromium-driver``,
driven by selenium), and ``GET /experts`` against ``/metrics``.

Screenshots are saved under the test's tmp directory; with ``GGML_HYBRID_DOCS_IMAGES=DIR`` also into DIR (the
docs' pictures are made so: ``GGML_HYBRID_DOCS_IMAGES=docs/images pytest tests/test_page.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_server import Server, get, scrape

from ggml_hybrid.server.web import CSP
from ggml_hybrid.synthetic import write_model

openai = pytest.importorskip("openai")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
WAIT = 60.0  # seconds a bounded wait for the page allows (the machine may be loaded)
HOSTILE = ('Here: <script>document.title="pwned"</script> and <img src=x onerror="document.title=\'pwned\'">\n\n'
           '```html\n<script>alert(1)</script>\n```\n- **bold** `<b>code</b>`')


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("page")
    return write_model(d / "slow.gguf", arch="qwen3moe", weight_type="q8_0", seed=4, n_layer=4, n_embd=256,
                       n_ff_exp=256, head_dim=64, n_expert=16, n_used=4)


# --ignore-eos: an answer ends at its max_tokens, never early at an end token this random model may pick (the
# stopped answer's test needs it running when Stop is clicked: at 6,000 tokens it once ended by itself first)
SERVE = ["-np", "2", "-c", "16384", "-t", "1", "-a", "m", "--disk-experts", "--expert-cache-slots", "6",
         "--moe-cpu-share", "0.5", "--ignore-eos"]


@pytest.fixture(scope="module")
def server(model_file):
    with Server([model_file, *SERVE]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0, err


def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("the browser checks need Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))


@pytest.fixture
def driver():
    d = browser()
    try:
        yield d
    finally:
        d.quit()


def wait_for(what, cond, timeout: float = WAIT):
    """Poll ``cond`` until it returns something true (bounded): the browser's work is asynchronous."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def by_id(d, id_: str):
    return d.find_element("id", id_)


def severe(d) -> list[str]:
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]


def shot(d, tmp_path: Path, name: str) -> Path:
    p = tmp_path / name
    d.save_screenshot(str(p))
    out = os.environ.get("GGML_HYBRID_DOCS_IMAGES")
    if out:
        shutil.copy(p, Path(out) / name)
    return p


def open_page(d, url: str) -> None:
    d.get(url + "/")
    wait_for("the page to list the models", lambda: d.find_elements("id", "page-ready"))


def send(d, text: str, max_tokens: int, temperature: float = 0.0) -> None:
    for id_, v in (("temperature", temperature), ("max-tokens", max_tokens)):
        el = by_id(d, id_)
        el.clear()
        el.send_keys(str(v))
    by_id(d, "input").send_keys(text)
    by_id(d, "send").click()


def answers_done(d) -> int:
    return len(d.find_elements("css selector", "meta.answer-done"))


def stored(d) -> list[dict]:
    return json.loads(d.execute_script("return localStorage.getItem('ggml-hybrid.conversation')") or "[]")


def view_steps(d) -> int:
    return int(by_id(d, "view-state").get_attribute("data-steps") or -1)


def test_root_is_the_page_to_a_browser_and_the_api_404_otherwise(server):
    req = urllib.request.Request(server.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert r.headers["Content-Security-Policy"] == CSP and "unsafe-inline" not in CSP
        page = r.read().decode()
    assert "<script>" not in page and 'src="/web/app.js"' in page  # no inline script: all of it from app.js
    status, body = get(server.url + "/")  # an API client at the root: the API's 404 as before
    assert status == 404 and json.loads(body)["error"]["message"].startswith("Not found")


def test_chat_streams_the_apis_answer_stops_and_the_view_follows(server, driver, tmp_path):
    d = driver
    open_page(d, server.url)
    # the page's window starts at its first read: taken with the server idle, when /metrics says the same
    wait_for("the page's first view read", lambda: view_steps(d) >= 0)
    m0 = scrape(server.url)
    msg = "Once upon a time"
    send(d, msg, 16)
    wait_for("the answer", lambda: answers_done(d) >= 1)
    conv = stored(d)
    want = server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": msg}],
                                                    max_tokens=16, temperature=0).choices[0].message.content
    assert [m["role"] for m in conv] == ["user", "assistant"] and conv[1]["content"] == want
    assert want and by_id(d, "messages").find_elements("css selector", ".msg.assistant .body")[0].text.strip()
    assert "time to first token: " in by_id(d, "ttft").text and by_id(d, "ttft").text[-1] == "s"
    assert by_id(d, "tps").text.startswith("tokens/s: ")

    wait_for("the page to read the view after the answer", lambda: view_steps(d) == view_steps_now(server))
    steps0 = view_steps(d)
    by_id(d, "window").find_element("css selector", "option[value='300']").click()
    send(d, "The cache runs the hits first", 6000)  # seconds of decoding: Stop comes well before its end
    # while the answer runs, the view moves
    wait_for("the view to move during the request",
             lambda: by_id(d, "stop").is_enabled() and view_steps(d) > steps0 + 2, timeout=WAIT)
    assert by_id(d, "stop").is_enabled()
    shot(d, tmp_path, "page-chat.png")
    by_id(d, "stop").click()
    wait_for("the stopped answer", lambda: answers_done(d) >= 2)
    conv = stored(d)
    assert conv[-1].get("stopped") is True and conv[-1]["content"], [k for k in conv[-1] if k != "content"]
    key = ("ggml_hybrid_requests_total", (("finish_reason", "cancelled"), ("model", "slow")))
    wait_for("the server to cancel the stopped request", lambda: scrape(server.url).get(key, 0) >= 1)
    m1 = scrape(server.url)
    wait_for("a view read after the stop", lambda: view_steps(d) == view_steps_now(server))
    lab = (("model", "slow"),)  # the file's stem; "m" is its alias
    pairs = {"hits": "win-hits", "misses": "win-misses", "cpu_misses": "win-cpu", "bytes_loaded": "win-bytes"}
    for metric, el in pairs.items():
        name = f"ggml_hybrid_expert_cache_{metric}_total"
        shown = int(by_id(d, el).text.replace(",", ""))
        total = int(by_id(d, "total-" + el[4:]).text.replace(",", ""))
        assert total == m1[(name, lab)], metric
        # the window (300 s) starts at the page's first read, before the first answer
        assert shown == m1[(name, lab)] - m0.get((name, lab), 0) > 0, metric
    assert by_id(d, "layers").find_elements("css selector", "tr")
    assert severe(d) == []


def view_steps_now(server) -> int:
    status, body = get(server.url + "/experts?heatmap=0")
    assert status == 200
    return json.loads(body)["steps"]


def test_a_hostile_answer_renders_as_text(server, driver, tmp_path):
    """The model's answer is forced (a grammar the test adds to the page's request) to hold a script, an image with
    onerror and Markdown around markup: streamed into the page, and again rendered from the stored conversation
    after a reload, it shows as text; nothing runs."""
    d = driver
    open_page(d, server.url)
    d.execute_script("""
        const grammar = arguments[0], f = window.fetch;
        window.fetch = (url, opts) => {
          if (url === '/v1/chat/completions') {
            const body = JSON.parse(opts.body);
            body.grammar = grammar;
            opts = {...opts, body: JSON.stringify(body)};
          }
          return f(url, opts);
        };""", "root ::= " + json.dumps(HOSTILE))
    send(d, "show me", 400)
    wait_for("the answer", lambda: answers_done(d) >= 1)
    assert stored(d)[-1]["content"] == HOSTILE  # the model's own answer, streamed
    for reload in (False, True):
        if reload:  # the same answer from the stored conversation
            open_page(d, server.url)
        body = d.find_elements("css selector", ".msg.assistant .body")[-1]
        assert body.find_elements("css selector", "script, img, [onerror]") == []
        assert "<script>document.title" in body.text and "onerror=" in body.text
        assert body.find_element("css selector", "pre code").text == "<script>alert(1)</script>"
        assert body.find_element("css selector", "li strong").text == "bold"
        assert body.find_element("css selector", "li code").text == "<b>code</b>"
    assert d.title == "ggml-hybrid"  # nothing ran
    assert severe(d) == []
    shot(d, tmp_path, "page-hostile.png")


def test_a_server_with_a_key_refuses_the_page_until_it_is_given(model_file, driver, tmp_path):
    d = driver
    with Server([model_file, "-c", "256", "-t", "1", "-a", "m", "--api-key", "sekrit"]) as s:
        d.get(s.url + "/")  # the page itself needs no key
        form = wait_for("the key form", lambda: by_id(d, "key-form").is_displayed() and by_id(d, "key-form"))
        assert "needs an API key" in by_id(d, "key-reason").text
        assert by_id(d, "model").find_elements("tag name", "option") == []
        status, _ = get(s.url + "/experts")
        assert status == 401
        by_id(d, "key").send_keys("wrong")
        by_id(d, "save-key").click()
        wait_for("the refusal of a wrong key", lambda: form.is_displayed() and "refused" in by_id(d, "key-reason").text)
        by_id(d, "key").send_keys("sekrit")
        by_id(d, "save-key").click()
        wait_for("the models", lambda: d.find_elements("id", "page-ready"))
        assert not form.is_displayed()
        assert d.execute_script("return localStorage.getItem('ggml-hybrid.key')") == '"sekrit"'
        send(d, "a", 4)
        wait_for("the answer", lambda: answers_done(d) >= 1)
        assert not stored(d)[-1].get("error")
        wait_for("a view read", lambda: view_steps(d) >= 1)
        # the only console errors: the two refused calls (a browser logs every 401)
        assert all("401" in m for m in severe(d))
        rc, err = s.stop()
    assert rc == 0, err


def test_bad_view_queries_are_400s(server):
    for q in ("window=3", "heatmap=2", "heatmap=", "heatmap=1&heatmap=0", "x=1"):
        status, body = get(server.url + "/experts?" + q)
        assert status == 400, q
        assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_the_views_counters_equal_metrics_and_its_heatmap_the_layers(server):
    c = server.client()
    c.completions.create(model="m", prompt="slots and", max_tokens=8, temperature=0)
    status, body = get(server.url + "/experts")
    m = scrape(server.url)
    view = json.loads(body)
    lab = (("model", "slow"),)  # the file's stem; "m" is its alias
    for k, v in view["totals"].items():
        assert v == m[(f"ggml_hybrid_expert_cache_{k}_total", lab)], k
        assert v == sum(layer[k] for layer in view["layers"])
    hm = view["heatmap"]
    assert hm["n_expert"] == 16 and hm["layers"] == [x["layer"] for x in view["layers"] if x["mode"] == "disk"]
    for layer, row, held in zip(view["layers"], hm["requests"], hm["held"]):
        # every call's distinct experts were asked for once each: on the device (hit, load) or the CPU
        assert sum(row) == layer["distinct"] == layer["hits"] + layer["misses"] + layer["cpu_misses"]
        assert len(held) <= 6 and held == sorted(set(held)) and all(0 <= e < 16 for e in held)


def test_a_hundred_open_pages_leave_health_fast(server):
    stop = threading.Event()
    errors: list[str] = []

    def page() -> None:
        while not stop.is_set():
            status, _ = get(server.url + "/experts")
            if status != 200:
                errors.append(str(status))

    threads = [threading.Thread(target=page, daemon=True) for _ in range(100)]
    for t in threads:
        t.start()
    try:
        c = server.client()
        c.completions.create(model="m", prompt="a", max_tokens=4, temperature=0)
        worst = 0.0
        for _ in range(10):
            t0 = time.perf_counter()
            assert get(server.url + "/health")[0] == 200
            worst = max(worst, time.perf_counter() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == [] and worst < 1.0, (errors[:3], worst)
