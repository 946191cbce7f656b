"""API faults: bad arguments to the public Python objects, each call in a forked child.

A case is one call (a target below) with one argument replaced by a value from a pool of wrong
types, wrong shapes, boundary numbers and odd objects. The call may succeed (the value was
acceptable) or raise a ggml-hybrid error (``GgmlHybridError``): both are fine. Any other exception
is ``untyped``; a crash, an abort or a hang is caught by the fork around it.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Callable
from typing import Any

from .proc import classify, run_forked


def values(folder: str) -> list[tuple[str, Callable[[], Any]]]:
    """(label, factory) of every odd value; factories, so that each case gets a fresh object."""
    import numpy as np

    junk = os.path.join(folder, "junk.gguf")
    return [
        ("None", lambda: None), ("True", lambda: True), ("-1", lambda: -1), ("0", lambda: 0), ("1", lambda: 1),
        ("2**64", lambda: 2**64), ("-2**63", lambda: -2**63), ("1.5", lambda: 1.5), ("nan", lambda: math.nan),
        ("inf", lambda: math.inf), ("''", lambda: ""), ("'x'", lambda: "x"), ("b'x'", lambda: b"x"),
        ("[]", lambda: []), ("[1]", lambda: [1]), ("[[1]]", lambda: [[1]]), ("[-1]", lambda: [-1]),
        ("[2**40]", lambda: [2**40]), ("[1.5]", lambda: [1.5]), ("['a']", lambda: ["a"]), ("{}", lambda: {}),
        ("{'a': 1}", lambda: {"a": 1}), ("object()", lambda: object()), ("np.int64(3)", lambda: np.int64(3)),
        ("np.float32(1)", lambda: np.float32(1)), ("np.array([1,2],int32)", lambda: np.array([1, 2], np.int32)),
        ("np.array([[1]])", lambda: np.array([[1]])), ("np.array([1.5])", lambda: np.array([1.5])),
        ("np.array([],int32)", lambda: np.array([], np.int32)), ("np.zeros((2,0))", lambda: np.zeros((2, 0))),
        ("np.array([1],uint64)", lambda: np.array([2**63], np.uint64)), ("range(3)", lambda: range(3)),
        ("iter([1])", lambda: iter([1])), ("folder", lambda: folder), ("junk file", lambda: _junk(junk)),
        ("lambda", lambda: (lambda *a: None)), ("'\\x00'", lambda: "\x00"), ("'a'*5000", lambda: "a" * 5000),
        ("np.float32 2x8 nan", lambda: np.full((2, 8), np.nan, np.float32)),
    ]


def _junk(path: str) -> str:
    with open(path, "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    return path


class Env:
    """What a target works on: the valid model files and one set of options; imports happen in the child."""

    def __init__(self, model: str, stack: str, field: str) -> None:
        import ggml_hybrid as gh

        self.gh, self.model, self.stack, self.field = gh, model, stack, field
        self.one = gh.SessionOptions(n_threads=1)

    def with_model(self, fn: Callable[[Any], Any]) -> Any:
        with self.gh.MoEModel(self.model, self.one) as m:
            return fn(m)

    def with_store(self, fn: Callable[[Any], Any]) -> Any:
        from ggml_hybrid.gguf.store import GGUFStore

        s = GGUFStore(self.model)
        try:
            return fn(s)
        finally:
            s.close()

    def closed_eval(self, v: Any) -> Any:
        m = self.gh.MoEModel(self.model, self.one)
        m.close()
        return m.eval(v)

    def stack_forward(self, v: Any) -> Any:
        with self.gh.MoEStackSession(self.stack, self.one) as s:
            return s.forward(v)

    def in_context(self, fn: Callable[[Any], Any]) -> Any:
        c = self.gh.Context(n_tensors=8)
        try:
            return fn(c)
        finally:
            c.close()

    def plan(self, *a: Any, **kw: Any) -> Any:
        from ggml_hybrid.plan.planner import plan

        return plan(self.model, *a, **kw)


def _store(v: Any) -> None:
    from ggml_hybrid.gguf.store import GGUFStore

    GGUFStore(v).close()


def _describe(v: Any) -> Any:
    from ggml_hybrid.plan.model_info import describe

    return describe(v)


def _ones() -> Any:
    import numpy as np

    return np.ones(32, np.float32)


# name -> call(bad value v, env e)
TARGETS: dict[str, Callable[[Any, Env], Any]] = {
    "SessionOptions(field=v)": lambda v, e: e.gh.SessionOptions(**{e.field: v}),
    "SessionOptions.parse(v)": lambda v, e: e.gh.SessionOptions.parse(v),
    "SessionOptions.parse([v])": lambda v, e: e.gh.SessionOptions.parse([v]),
    "SessionOptions.from_dict(v)": lambda v, e: e.gh.SessionOptions.from_dict(v),
    "options.merged(field=v)": lambda v, e: e.one.merged(**{e.field: v}),
    "MoEModel(v)": lambda v, e: e.gh.MoEModel(v, e.one).close(),
    "MoEModel(path, options=v)": lambda v, e: e.gh.MoEModel(e.model, v).close(),
    "MoEModel(path, device=v)": lambda v, e: e.gh.MoEModel(e.model, e.one, device=v).close(),
    "MoEModel(path, progress=v)": lambda v, e: e.gh.MoEModel(e.model, e.one, progress=v).close(),
    "MoEModel(path, dry_run_devices=v)": lambda v, e: e.gh.MoEModel(e.model, e.one, dry_run_devices=v).close(),
    "model.eval(v)": lambda v, e: e.with_model(lambda m: m.eval(v)),
    "model.eval([1, 2], logits=v)": lambda v, e: e.with_model(lambda m: m.eval([1, 2], v)),
    "closed model.eval(v)": lambda v, e: e.closed_eval(v),
    "model.device_memory(v)": lambda v, e: e.with_model(lambda m: m.device_memory(v)),
    "model.backend(v)": lambda v, e: e.with_model(lambda m: m.backend(v)),
    "generate(model, v, 2)": lambda v, e: e.with_model(lambda m: "".join(e.gh.generate(m, v, 2))),
    "generate(model, [1], v)": lambda v, e: e.with_model(lambda m: "".join(e.gh.generate(m, [1], v))),
    "generate(model, [1], 2, sampler=v)": lambda v, e: e.with_model(lambda m: "".join(e.gh.generate(m, [1], 2, v))),
    "complete(model, [1], 2, keep_logits=v)": lambda v, e: e.with_model(lambda m: e.gh.complete(m, [1], 2,
                                                                                                 keep_logits=v)),
    "Sampler(temperature=v)": lambda v, e: e.gh.Sampler(temperature=v),
    "Sampler(top_k=v)": lambda v, e: e.gh.Sampler(top_k=v),
    "Sampler(top_p=v)": lambda v, e: e.gh.Sampler(top_p=v),
    "Sampler(seed=v)": lambda v, e: e.gh.Sampler(seed=v),
    "Sampler(temperature=1)(v)": lambda v, e: e.gh.Sampler(temperature=1.0, seed=1)(v),
    "tokenizer.encode(v)": lambda v, e: e.with_model(lambda m: m.tokenizer.encode(v)),
    "tokenizer.encode('hi', add_bos=v)": lambda v, e: e.with_model(lambda m: m.tokenizer.encode("hi", v)),
    "tokenizer.decode(v)": lambda v, e: e.with_model(lambda m: m.tokenizer.decode(v)),
    "tokenizer.token_bytes(v)": lambda v, e: e.with_model(lambda m: m.tokenizer.token_bytes(v)),
    "GGUFStore(v)": lambda v, e: _store(v),
    "store.meta(v)": lambda v, e: e.with_store(lambda s: s.meta(v)),
    "store.meta('general.name', kind=v)": lambda v, e: e.with_store(lambda s: s.meta("general.name", kind=v)),
    "store.info(v)": lambda v, e: e.with_store(lambda s: s.info(v)),
    "store.raw(v)": lambda v, e: e.with_store(lambda s: s.raw(v)),
    "store.validate_data(v)": lambda v, e: e.with_store(lambda s: s.validate_data(v)),
    "MoEStackSession(path, options=v)": lambda v, e: e.gh.MoEStackSession(e.stack, v).close(),
    "stack.forward(v)": lambda v, e: e.stack_forward(v),
    "describe(v)": lambda v, e: _describe(v),
    "plan(path, v)": lambda v, e: e.plan(v),
    "plan(path, vram=v)": lambda v, e: e.plan(e.one, vram=v),
    "plan(path, ram=v)": lambda v, e: e.plan(e.one, ram=v),
    "plan(path, parallel=v)": lambda v, e: e.plan(e.one, parallel=v),
    "cpu(v)": lambda v, e: e.gh.cpu(v).close(),
    "Context(n_tensors=v)": lambda v, e: e.gh.Context(n_tensors=v).close(),
    "Context.new_tensor(v, (2, 2))": lambda v, e: e.in_context(lambda c: c.new_tensor(v, (2, 2))),
    "Context.new_tensor('f32', v)": lambda v, e: e.in_context(lambda c: c.new_tensor("f32", v)),
    "as_ggml_type(v)": lambda v, e: e.gh.as_ggml_type(v),
    "quantize(v, 'q8_0')": lambda v, e: e.gh.quantize(v, "q8_0"),
    "quantize(ones(32), v)": lambda v, e: e.gh.quantize(_ones(), v),
    "dequantize(v, 'q8_0', (32,))": lambda v, e: e.gh.dequantize(v, "q8_0", (32,)),
}


def run_case(seed: int, index: int, model: str, stack: str, folder: str, timeout: float) -> dict[str, Any]:
    rng = random.Random(f"api:{seed}:{index}")
    os.makedirs(folder, exist_ok=True)
    pool = values(folder)
    target = rng.choice(sorted(TARGETS))
    label, make = rng.choice(pool)
    from ggml_hybrid.options import SessionOptions

    field = rng.choice([r[0] for r in SessionOptions.describe()])  # for the 'field=v' targets
    name = target.replace("field=", field + "=")  # the label; ``target`` stays the key

    def child() -> int:
        from ggml_hybrid.errors import GgmlHybridError

        try:
            TARGETS[target](make(), Env(model, stack, field))
        except GgmlHybridError as exc:
            print(f"TYPED {type(exc).__name__}: {exc}"[:500])
            return 0
        except Exception as exc:
            print(f"UNTYPED {type(exc).__module__}.{type(exc).__name__}: {exc}"[:500], file=sys.stderr)
            return 3
        print("ACCEPTED")
        return 0

    o = run_forked(child, folder, timeout)
    cls = "untyped" if o.rc == 3 and "UNTYPED" in o.stderr else classify(o)
    return {"index": index, "target": name, "value": label, "class": cls,
            "results": {"api": {"class": cls, "rc": o.rc, "stdout": o.stdout[-300:], "stderr": o.stderr[-1500:],
                                "args": [f"{name} with v = {label}"]}}}


__all__ = ["TARGETS", "Env", "run_case", "values"]
