#!/usr/bin/env python3
"""What tokenizing through ``encode_batch`` costs and what it frees (issue 40 E2).

``Tokenizer.encode`` called the ``tokenizers`` package's ``encode``, which holds the interpreter for the whole
text: a server's event loop stood still for as long as a long text took. It now calls ``encode_batch`` with one
text, which lets other threads run meanwhile and gives the same ids. Two measurements, one process, one thread of
ours (the tokenizer's own threads as the server has them):

- the time per call of each arm (A: ``encode``, main's; B: ``encode_batch``) on texts of 64 characters (a chat
  turn), 4 KiB and 400 KiB, in alternating order (A B, then B A) after a warm-up; the median of each and B/A;
  every call's ids checked equal;
- the longest stall of a thread that wakes every millisecond (what an event loop sees) while the other thread
  tokenizes the 400 KiB text once by each arm, the median over the rounds.

    python tools/bench/bench_tokenize.py [--model FILE.gguf] [--rounds 30] [--warmup 5]
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time

import click

TEXT = "The cache runs the hits first, 123 émoji ☃ and the misses after them; "
SIZES = {"64 chars": 64, "4 KiB": 4 << 10, "400 KiB": 400 << 10}


def _text(n: int) -> str:
    return (TEXT * (n // len(TEXT) + 1))[:n]


def _arms(hf):  # type: ignore[no-untyped-def]
    return {"A encode": lambda t: hf.encode(t, add_special_tokens=False).ids,
            "B encode_batch": lambda t: hf.encode_batch([t], add_special_tokens=False)[0].ids}


def _stall(fn, text: str) -> float:  # type: ignore[no-untyped-def]
    """The longest gap between the wake-ups of a thread sleeping 1 ms while ``fn(text)`` runs here."""
    stop = threading.Event()
    gaps = [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    th = threading.Thread(target=tick)
    th.start()
    fn(text)
    stop.set()
    th.join()
    return gaps[0]


@click.command()
@click.option("--model", default=None, help="A GGUF with a byte-level BPE vocabulary (default: a generated qwen3moe).")
@click.option("--rounds", default=30, show_default=True, type=click.IntRange(2))
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0))
def main(model: str | None, rounds: int, warmup: int) -> None:
    from ggml_hybrid.gguf.store import GGUFStore
    from ggml_hybrid.synthetic import write_model
    from ggml_hybrid.text.tokenizer import Tokenizer

    if model is None:
        model = write_model(tempfile.mkdtemp() + "/m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    tok = Tokenizer.from_gguf(GGUFStore(model))
    hf = getattr(tok, "_hf", None)
    if hf is None:
        raise click.UsageError(f"{model}: a SentencePiece vocabulary (this compares the byte-level BPE path)")
    arms = _arms(hf)
    print(f"model {model}: {len(tok.tokens)} tokens")
    print("| text | tokens | A encode µs | B encode_batch µs | B/A |")
    print("| --- | --- | --- | --- | --- |")
    for label, n in SIZES.items():
        text = _text(n)
        want = arms["A encode"](text)
        times: dict[str, list[float]] = {k: [] for k in arms}
        reps = max(1, int(2e5 // n))  # calls per timing: short texts timed over many calls
        for r in range(warmup + rounds):
            order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
            for k, fn in order:
                t0 = time.perf_counter()
                for _ in range(reps):
                    got = fn(text)
                dt = (time.perf_counter() - t0) / reps
                assert got == want, f"{k}: other ids than encode's"
                if r >= warmup:
                    times[k].append(dt)
        a, b = (statistics.median(times[k]) * 1e6 for k in arms)
        print(f"| {label} | {len(want)} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    text = _text(SIZES["400 KiB"])
    stalls: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(max(3, rounds // 5)):
        order = list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]
        for k, fn in order:
            stalls[k].append(_stall(fn, text))
    print("| arm | longest stall of a 1 ms ticker while 400 KiB are tokenized, median of rounds (ms) |")
    print("| --- | --- |")
    for k, v in stalls.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
