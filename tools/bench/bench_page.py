#!/usr/bin/env python3
"""What the chat page's expert view costs a server: decode tok/s with the page open and refreshing vs closed.

One ``ggml-hybrid serve`` of the ``small`` synthetic model of bench_serve.py (4 layers, embd 256, 16 experts top-4,
Q8_0) with its experts behind the cache (``--disk-experts --expert-cache-slots 6``, ``-t 1``). Each measurement is
one ``/v1/completions`` of --n tokens (``ignore_eos``, temperature 0); its decode tok/s is the server's
``timings.predicted_per_second`` (first token to last). ``closed``: nothing else talks to the server; ``open``: a
viewer polls ``GET /experts`` (heatmap included) every second for the whole request, as the page does while it is
visible. ``--viewer poll`` (default) is that poll from this process; ``--viewer browser`` opens the page itself in
headless Chromium (selenium; the browser's own CPU use is then part of what is measured on a small machine).
Rounds alternate closed, open, open, closed after one warm-up of each; the medians and open/closed are printed.
Then, in this process on the same model and options, what one poll costs: the engine thread's read
(``expert_view.read_view``, heatmap included) and the answer's JSON encoding, median over 200 reads, beside the
median decode step; one poll a second costs read / 1 s of the engine's time.

    python tools/bench/bench_page.py [--rounds 6] [--n 768] [--viewer poll|browser]
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
import urllib.request

import click
from bench_serve import Server, model_path

from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.engine import EngineStats
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.server.expert_view import read_view

POLL_S = 1.0  # the page's poll interval (app.js POLL_MS)


class Poller:
    """GET /experts every POLL_S seconds until stopped: the page's requests without a browser."""

    def __init__(self, url: str) -> None:
        self.url, self.stop_ev, self.polls = url, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_ev.is_set():
            with urllib.request.urlopen(self.url + "/experts?model=m", timeout=60) as r:
                r.read()
            self.polls += 1
            self.stop_ev.wait(POLL_S)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_ev.set()
        self.thread.join(60)


class Browser:
    """The page open in headless Chromium, polling while it is visible."""

    def __init__(self, url: str) -> None:
        from selenium import webdriver

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or "chromium"
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            opts.add_argument(a)
        self.d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(shutil.which("chromedriver")))
        self.url, self.polls = url, 0

    def __enter__(self) -> Browser:
        self.d.get(self.url + "/")
        end = time.monotonic() + 60
        while not self.d.find_elements("id", "page-ready") and time.monotonic() < end:
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.d.get("about:blank")  # the page closed: its polls stop

    def close(self) -> None:
        self.d.quit()


@click.command()
@click.option("--rounds", default=6, show_default=True, help="closed/open pairs measured (after one warm-up pair)")
@click.option("--n", default=768, show_default=True, help="tokens per request")
@click.option("--viewer", type=click.Choice(["poll", "browser"]), default="poll", show_default=True)
def main(rounds: int, n: int, viewer: str) -> None:
    path, vocab = model_path("small")
    server = Server(path, ["-np", "1", "-c", "1024", "-t", "1", "--disk-experts", "--expert-cache-slots", "6"])
    browser = Browser(server.url) if viewer == "browser" else None
    prompt = [(7 * i + 3) % vocab for i in range(16)]
    results: dict[str, list[float]] = {"closed": [], "open": []}
    polls = 0
    try:
        for i in range(rounds + 1):
            order = ["closed", "open"] if i % 2 == 0 else ["open", "closed"]
            for mode in order:
                if mode == "closed":
                    r = server.complete(prompt, n)
                else:
                    ctx = browser if browser is not None else Poller(server.url)
                    with ctx:
                        r = server.complete(prompt, n)
                    polls += getattr(ctx, "polls", 0)
                assert r["usage"]["completion_tokens"] == n
                if i > 0:  # round 0 warms both up
                    results[mode].append(r["timings"]["predicted_per_second"])
    finally:
        if browser is not None:
            browser.close()
        server.close()
    closed, opened = statistics.median(results["closed"]), statistics.median(results["open"])
    print(f"viewer {viewer}, {rounds} rounds of {n} tokens; polls during 'open': {polls}")
    print(f"closed: median {closed:.1f} tok/s  {[round(x, 1) for x in results['closed']]}")
    print(f"open:   median {opened:.1f} tok/s  {[round(x, 1) for x in results['open']]}")
    print(f"open / closed: {opened / closed:.3f}")
    read_cost(path, n)


def read_cost(path: str, n: int) -> None:
    """Median seconds of one view read (and its JSON), and of one decode step, in this process."""
    from types import SimpleNamespace

    opts = SessionOptions(n_threads=1, n_ctx=1024, disk_experts=True, expert_cache_slots=6)
    with MoEModel(path, opts) as m:
        m.eval([1, 2, 3, 4])
        steps = []
        for i in range(min(n, 200)):
            t0 = time.perf_counter()
            m.decode([(0, 5 + i % 50)])
            steps.append(time.perf_counter() - t0)
        sm = SimpleNamespace(model=m, engine=SimpleNamespace(stats=EngineStats()), name="m")
        reads, dumps = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            view = read_view(sm, True)  # type: ignore[arg-type]
            t1 = time.perf_counter()
            json.dumps(view)
            reads.append(t1 - t0)
            dumps.append(time.perf_counter() - t1)
    step, read, dump = (statistics.median(x) for x in (steps, reads, dumps))
    print(f"one decode step: {step * 1e3:.2f} ms; one view read on the engine thread: {read * 1e6:.0f} us "
          f"({read / step:.1%} of a step; at one poll a second, {read:.2e} of the engine's time); "
          f"its JSON: {dump * 1e6:.0f} us")


if __name__ == "__main__":
    main()
