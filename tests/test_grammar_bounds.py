"""Bounded grammar compiles through the Python API (issue 40: E1, E5, E9, E10, E11, E16).

A schema or grammar that would overflow llguidance's recursion is refused before it reaches it, naming the bound
(the shapes that took the interpreter down with SIGSEGV are run in a child process); one that slips past the counts
takes only the checker's process down; a compile over its time is stopped; bounds llguidance cannot hold exactly and
llguidance's own options are refused; a grammar that cannot go on past its first token is refused at compile time,
and one that fails later fails as a GrammarError; a constrained text never ends "stop" on text that does not parse."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from helpers import assert_typed_error_isolated, run_isolated  # noqa: E402

from ggml_hybrid.errors import GgmlHybridError, GrammarError  # noqa: E402
from ggml_hybrid.gguf.store import GGUFStore  # noqa: E402
from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.runtime.engine import Engine, Request  # noqa: E402
from ggml_hybrid.runtime.grammar import Grammar  # noqa: E402
from ggml_hybrid.runtime.moe_model import MoEModel  # noqa: E402
from ggml_hybrid.runtime.sampling import Sampler  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402
from ggml_hybrid.text.tokenizer import Tokenizer  # noqa: E402


def ref_chain(n: int, via: str = "") -> dict:
    """A schema whose $ref chain is ``n`` long; ``via``: each hop through that keyword ("properties", "items")."""
    def hop(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"properties": {"a": ref}} if via == "properties" else {"items": ref} if via == "items" else ref
    defs = {f"d{i}": hop(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f"r{i} ::= r{i + 1}" for i in range(n)] + [f'r{n} ::= "x"'])


def lark_chain(n: int, token: bool = False) -> str:
    name = (lambda i: f"T{i}") if token else (lambda i: f"r{i}")
    return "\n".join([f"start: {name(0)}"] + [f"{name(i)}: {name(i + 1)}" for i in range(n)] + [f'{name(n)}: "x"'])


NEAR_MIN = -(2 ** 63) + 2

# each took the interpreter down on main (SIGSEGV: the first seven a stack overflow in llguidance's compile, the last
# its integer-range code near -2**63); each is now refused before llguidance sees it, naming the bound
CRASHES = {
    "ref-chain-2500": ("json_schema", ref_chain(2500), "levels deep"),
    "ref-chain-through-properties-1800": ("json_schema", ref_chain(1800, "properties"), "levels deep"),
    "ref-chain-through-items-2000": ("json_schema", ref_chain(2000, "items"), "levels deep"),
    "gbnf-chain-4000": ("gbnf", gbnf_chain(4000), "levels deep"),
    "lark-chain-5000": ("lark", lark_chain(5000), "levels deep"),
    "lark-token-chain-8000": ("lark", lark_chain(8000, token=True), "levels deep"),
    "lark-json-block-ref-chain": ("lark", f"start: %json {json.dumps(ref_chain(2500))}", "levels deep"),
    "integer-bounds-near-min": ("json_schema", {"type": "integer", "minimum": NEAR_MIN, "maximum": NEAR_MIN}, "2**53"),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gb") / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    t = Tokenizer.from_gguf(GGUFStore(str(model_path)))
    assert isinstance(t, Tokenizer)
    return t


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_what_crashed_the_interpreter_is_refused_naming_the_bound(model_path, tmp_path, name):
    kind, source, bound = CRASHES[name]
    src = tmp_path / "source.json"
    src.write_text(json.dumps(source))
    code = f"""
        import json
        from ggml_hybrid.gguf.store import GGUFStore
        from ggml_hybrid.runtime.grammar import Grammar
        from ggml_hybrid.text.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(GGUFStore({str(model_path)!r}))
        try:
            getattr(Grammar, {kind!r})(tok, json.load(open({str(src)!r})), "the input")
        except gh.errors.GrammarError as exc:
            assert {bound!r} in str(exc), str(exc)
            raise
    """
    assert_typed_error_isolated(code, "GrammarError")


# a forced tool call's grammar (server/tool_grammar.py: Lark text with a %json block per call, or per argument in the
# XML formats, each carrying the tool's parameters as the root of its $refs)
DEEP_TOOLS = {
    "ref-chain-2500": ref_chain(2500),
    "ref-chain-through-properties-1800": ref_chain(1800, "properties"),
}


@pytest.mark.parametrize("chain", sorted(DEEP_TOOLS))
def test_a_forced_call_of_a_tool_with_a_deep_chain_is_refused_in_every_format(model_path, tmp_path, chain):
    """On main a tool whose parameters hold a 2,500-long $ref chain took the interpreter down (SIGSEGV) when its
    forced call was compiled, in every call format: here each format's grammar (``required`` and a named tool) is
    a 400 naming the bound, in one child process that must survive them all."""
    params = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"],
              "$defs": DEEP_TOOLS[chain]["$defs"]}
    src = tmp_path / "params.json"
    src.write_text(json.dumps(params))
    p = run_isolated(f"""
        import json
        from ggml_hybrid.gguf.store import GGUFStore
        from ggml_hybrid.server.protocol import APIError
        from ggml_hybrid.server.tools import FORMATS, read_tools, tools_grammar
        from ggml_hybrid.text.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(GGUFStore({str(model_path)!r}))
        tools = [{{"type": "function", "function": {{"name": "deep", "parameters": json.load(open({str(src)!r}))}}}}]
        for fmt in FORMATS:
            for choice in ("required", {{"type": "function", "function": {{"name": "deep"}}}}):
                req = read_tools({{"tools": tools, "tool_choice": choice}})
                try:
                    tools_grammar(tok, fmt, req)
                    print(json.dumps([fmt.name, "compiled"]))
                except APIError as exc:
                    print(json.dumps([fmt.name, exc.status, exc.param, exc.code, exc.message]))
    """, timeout=600)
    assert p.returncode == 0, f"child exit code {p.returncode}, stdout {p.stdout[-800:]!r}, stderr {p.stderr[-1500:]!r}"
    answers = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]
    from ggml_hybrid.server.tools import FORMATS

    assert sorted({a[0] for a in answers}) == sorted(f.name for f in FORMATS) and len(answers) == 2 * len(FORMATS)
    for a in answers:
        assert a[1:4] == [400, "tools", "invalid_tool_schema"] and "levels deep" in a[4] and "1000" in a[4], a


def test_the_counts_are_the_compilers_recursion():
    """The levels counted are the chain's length (a hop through 'properties' is two: the subschema and the $ref)."""
    from ggml_hybrid.runtime.grammar_check import grammar_levels, lark_levels, schema_levels

    assert schema_levels(ref_chain(10)) == 12
    assert schema_levels(ref_chain(10, "properties")) == 22
    assert schema_levels({"type": "object", "properties": {"a": {"items": {"type": "string"}}}}) == 3
    recursive = {"$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert schema_levels(recursive) == 4  # a cycle closes with a placeholder: it counts once
    assert grammar_levels(gbnf_chain(10), "g") == 12
    assert grammar_levels('root ::= a b\na ::= "x" | b\nb ::= "y"', "g") == 3
    assert lark_levels(lark_chain(10), "g") == 12 and lark_levels(lark_chain(10, token=True), "g") == 12
    assert lark_levels('start: a\n    | b\na: "x" %json {"items": {"items": {}}}\nb: "y"', "g") == 5
    assert grammar_levels('start: x\nx: "a" x | "a"', "g") == 3  # Lark text in the 'grammar' field


def test_chains_within_the_bound_compile_and_draw_valid_json(tok):
    """The bound leaves room: chains of up to MAX_LEVELS levels compile (on the pool's large stack), and what they
    draw validates (jsonschema, which follows the $refs itself, is the oracle)."""
    from ggml_hybrid.runtime.grammar import MAX_LEVELS
    from ggml_hybrid.runtime.grammar_check import schema_levels

    deep = ref_chain(MAX_LEVELS // 2 - 2, "properties")
    assert schema_levels(deep) <= MAX_LEVELS
    Grammar.json_schema(tok, deep)
    Grammar.gbnf(tok, gbnf_chain(MAX_LEVELS - 2))
    g = Grammar.json_schema(tok, ref_chain(200, "items"))
    text = draw(tok, g, seed=1)
    jsonschema.validate(json.loads(text), ref_chain(200, "items"))


def draw(tok, grammar: Grammar, seed: int, limit: int = 2000) -> str:
    rng = np.random.default_rng(seed)
    c = grammar.constraint()
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    out: list[int] = []
    for _ in range(limit):
        t = s(c.mask(rng.standard_normal(tok.n_vocab) * 3))
        c.accept(t)
        if t in tok.eog_ids:
            break
        out.append(t)
        if c.done:
            break
    return tok.decode(out)


def test_a_crash_that_slips_past_the_counts_takes_only_the_checker_down(tok):
    """A checker with a stack too small for a chain the counts allow: its process dies (SIGSEGV), the call is a
    GrammarError saying so, and the pool goes on with a new checker."""
    from ggml_hybrid.runtime.grammar_pool import GrammarPool

    pool = GrammarPool(threads=1, check_stack=256 << 10)
    try:
        with pytest.raises(GrammarError, match="took llguidance's compiler down"):
            Grammar.json_schema(tok, ref_chain(400, "properties"), pool=pool)
        assert draw(tok, Grammar.gbnf(tok, 'root ::= "yes" | "no"', pool=pool), seed=0) in ("yes", "no")
    finally:
        pool.close()


def slow_gbnf() -> str:
    """A GBNF grammar llguidance's reader takes minutes over (its terminal-rule fixpoint: one pass per rule of a
    chain defined top-down, each pass over a rule of 60,000 items), inside every count."""
    big = "big ::= " + " ".join(['"x"'] * 60_000) + " big"
    return "\n".join(["root ::= big a0", big] + [f"a{i} ::= a{i + 1}" for i in range(900)] + ['a900 ::= "x"'])


def test_a_compile_over_its_time_is_stopped_and_the_pool_goes_on(tok):
    from ggml_hybrid.runtime.grammar_pool import GrammarPool

    pool = GrammarPool(threads=1, seconds=120)
    try:
        Grammar.gbnf(tok, 'root ::= "a"', pool=pool)  # its checker started: the time below is the compile's alone
        pool.seconds = 0.5
        with pytest.raises(GrammarError, match=r"did not compile within 0\.5 s"):
            Grammar.gbnf(tok, slow_gbnf(), pool=pool)
        pool.seconds = 120
        assert Grammar.gbnf(tok, 'root ::= "yes" | "no"', "after", pool=pool).what == "after"
    finally:
        pool.close()


def test_compiles_run_on_the_pools_threads(tok):
    """Not on the caller's thread (whose stack is whatever it is), and at most ``threads`` at once."""
    from ggml_hybrid.runtime.grammar_pool import GrammarPool

    pool = GrammarPool(threads=2)
    seen: set[str] = set()
    lock = threading.Lock()

    def compile_on(spec: str) -> str:
        with lock:
            seen.add(threading.current_thread().name)
        return spec

    try:
        futures = [pool.submit({"kind": "gbnf", "source": 'root ::= "a"', "what": "g"}, compile_on) for _ in range(6)]
        assert all("start" in f.result(timeout=60) for f in futures)
    finally:
        pool.close()
    assert seen and seen <= {"grammar-compile-0", "grammar-compile-1"}


# -- what llguidance would have answered falsely ------------------------------------------------------------------

BOUNDS = [
    {"type": "integer", "minimum": 1e30, "maximum": 1e31},  # main: 9223372036854775807, ending "stop"
    {"type": "integer", "minimum": 9007199254740993, "maximum": 9007199254740993},  # main: 9007199254740992
    {"type": "integer", "maximum": -1e19},
    {"type": ["integer", "null"], "exclusiveMinimum": 1e20, "maximum": 1e21},
    {"type": "number", "minimum": 2 ** 60, "maximum": 2 ** 60 + 2},
    {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2 ** 54}}},
    {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": -(2 ** 64)}]},
]


@pytest.mark.parametrize("schema", BOUNDS, ids=[json.dumps(s) for s in BOUNDS])
def test_bounds_beyond_what_llguidance_holds_exactly_are_refused(tok, schema):
    with pytest.raises(GrammarError, match=r"2\*\*53"):
        Grammar.json_schema(tok, schema)


def test_bounds_within_2_53_give_valid_integers(tok):
    schema = {"type": "integer", "minimum": 2 ** 53 - 5, "maximum": 2 ** 53}
    g = Grammar.json_schema(tok, schema)
    for seed in range(3):
        jsonschema.validate(json.loads(draw(tok, g, seed)), schema)
    number = {"type": "number", "minimum": 0.5, "maximum": 1e17}  # a float bound of a number: as it is
    jsonschema.validate(json.loads(draw(tok, Grammar.json_schema(tok, number), 0)), number)


@pytest.mark.parametrize("xg", [5, "x", [], {"whitespace_pattern": "[a-z]+"}, {"lenient": True},
                                {"coerce_one_of": True}, {}])
def test_x_guidance_is_refused(tok, xg):
    """llguidance's own options are the server's: a client's (which let the text be non-JSON, or a non-object
    that raised TypeError) is refused."""
    with pytest.raises(GrammarError, match="x-guidance"):
        Grammar.json_schema(tok, {"type": "object", "x-guidance": xg})


# -- grammars that compile but cannot be decoded ------------------------------------------------------------------

WIDE = "big ::= " + " | ".join(f'"w{i}" r' for i in range(3000)) + '\nr ::= "x" r | "x"'


@pytest.mark.parametrize("text", ["root ::= (" + " | ".join(f'"w{i}"' for i in range(3000)) + ")",
                                  'root ::= "q" "z" big\n' + WIDE], ids=["3000-alternatives", "after-one-token"])
def test_a_grammar_that_cannot_go_past_its_first_token_is_refused_at_compile_time(tok, text):
    with pytest.raises(GrammarError, match="past its first token"):
        Grammar.gbnf(tok, text)


def test_a_grammar_that_fails_later_fails_as_a_grammar_error(tok):
    """Past the first token llguidance cannot tell at compile time: the step that passes its row limit is a
    GrammarError (the server answers it as a typed 400)."""
    g = Grammar.gbnf(tok, 'root ::= "q" [0-9]+ "z" big\n' + WIDE)
    with pytest.raises(GrammarError, match="items"):
        draw(tok, g, seed=0, limit=200)


# -- "stop" only on text that parses ---------------------------------------------------------------------------------

def test_stop_is_never_claimed_on_text_that_does_not_parse(model_path, tok):
    """If llguidance ever ended a JSON schema's text where it is not JSON, the request fails instead of ending
    "stop" (a grammar labelled as a schema stands in for such a fault); a schema's real end is "stop"."""
    with MoEModel(model_path, SessionOptions(n_threads=1, n_ctx=128, n_parallel=1)) as m:
        e = Engine(m)
        try:
            fake = Grammar.lark(m.tokenizer, 'start: "nope"')
            fake.kind = "json_schema"
            real = Grammar.json_schema(m.tokenizer, {"enum": ["yes", "no"]})
            reqs = [e.submit(Request(m.tokenizer.encode("Answer:"), Sampler(temperature=1.0, seed=1), 16,
                                     constraint=g.constraint())) for g in (fake, real)]
            for r in reqs:
                assert r.done.wait(120)
        finally:
            e.close()
    assert reqs[0].finish_reason == "error" and isinstance(reqs[0].exception, GgmlHybridError), reqs[0].error
    assert "does not parse" in (reqs[0].error or "")
    assert reqs[1].finish_reason == "stop" and json.loads(reqs[1].text) in ("yes", "no")


# -- the CPU time of one token's grammar work ------------------------------------------------------------------------

AMBIGUOUS = 'root ::= x\nx ::= x x | "a"'  # "aaa" parses many ways: llguidance's Earley work grows with every token


def test_the_step_bound_is_llguidances_step_limits_at_its_speeds():
    """The CPU bound of one token's grammar work is llguidance's step limits at its documented speeds (lexer fuel
    14,000 a millisecond, Earley items 20,000 a millisecond), twice over."""
    from ggml_hybrid.runtime.grammar import LIMITS, STEP_SECONDS

    assert STEP_SECONDS == pytest.approx(2 * (LIMITS["step_lexer_fuel"] / 14e6 + LIMITS["step_max_items"] / 20e6))


def test_an_ambiguous_grammar_ends_at_its_cpu_bound_and_the_other_requests_go_on(model_path):
    """An ambiguous grammar's mask costs more with every token (0.1 ms at token 100, 1 ms at 200, 24 ms at 600,
    up to 0.4 s near llguidance's row limit), on the engine thread where every other sequence waits for it. With its
    bound lowered to 2 ms here (the default, 34 ms, takes some 650 tokens and seconds of CPU to reach), the request
    ends with a GrammarError naming the bound well before max_tokens and llguidance's row limit (about 1,000
    tokens), and a request running beside it gets exactly the text it gets alone."""
    with MoEModel(model_path, SessionOptions(n_threads=1, n_ctx=1024, n_parallel=2)) as m:
        tok = m.tokenizer
        e = Engine(m)
        try:
            alone = e.submit(Request(tok.encode("Once upon a time"), Sampler(), 24))
            assert alone.done.wait(120)
            g = Grammar.gbnf(tok, AMBIGUOUS)
            g.step_seconds = 0.002
            # a negative presence penalty keeps drawing "a" (the only other choice the grammar leaves is the end)
            amb = Request(tok.encode("a"), Sampler(presence_penalty=-100.0), 900, constraint=g.constraint())
            other = Request(tok.encode("Once upon a time"), Sampler(), 24)
            e.submit(amb)
            e.submit(other)
            assert amb.done.wait(300) and other.done.wait(300)
        finally:
            e.close()
    assert amb.finish_reason == "error" and isinstance(amb.exception, GrammarError), (amb.finish_reason, amb.error)
    msg = str(amb.exception)
    assert "ms of CPU time, over the bound of 2.0 ms a token" in msg and "ambiguous" in msg, msg
    assert 100 < len(amb.tokens) < 700, len(amb.tokens)
    assert set(tok.decode(amb.tokens)) == {"a"}
    assert other.finish_reason == alone.finish_reason and other.tokens == alone.tokens
