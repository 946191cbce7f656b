"""SessionOptions: parsing, config mappings, precedence, round trips and error messages."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ggml_hybrid.errors import GgmlHybridError
from ggml_hybrid.ggml.backend import max_threads
from ggml_hybrid.options import MAX_DEVICES, OptionError, SessionOptions

MAXT = max_threads()  # 4 x the cores: the thread rule of the CPU backend

NAMES = [f.name for f in dataclasses.fields(SessionOptions)]
DEFAULT = SessionOptions()


# ---- valid options ---------------------------------------------------------------------------------

def test_defaults():
    assert DEFAULT.to_dict() == {
        "moe_cpu_share": 0.0, "expert_cache_slots": 0, "expert_eviction": "freq", "n_threads": None,
        "disk_experts": False, "cpu_moe": False, "n_cpu_moe": 0, "host_tier_bytes": 0, "trace_path": None,
        "n_ctx": 0, "n_parallel": 1, "batch_size": 2048, "ubatch_size": 512, "cache_type_k": "f16",
        "cache_type_v": "f16", "flash_attn": False, "n_gpu_layers": -1, "override_tensor": None, "split_mode": "layer",
        "tensor_split": None, "no_kv_offload": False, "check_tensors": False, "virtual_devices": 1,
        "moe_executor": "native", "rpc": None, "rpc_timeout": 120, "n_threads_batch": None, "devices": None, "poll": 0,
        "repack": True, "moe_prefetch": False, "moe_prefetch_bytes": 0, "moe_route_trace": None,
        "spec_type": "none", "draft_max": 3, "draft_min": 0, "draft_p_min": 0.0, "draft_backoff": True}
    assert DEFAULT.to_items() == []
    assert SessionOptions.parse([]) == DEFAULT
    assert SessionOptions.from_dict({}) == DEFAULT


def test_parse_every_field():
    o = SessionOptions.parse(["moe_cpu_share=0.25", "expert_cache_slots=16", "expert_eviction=LFU",
                              "n_threads=8", "disk_experts=yes", "cpu_moe=On", "n_cpu_moe=3",
                              "trace_path=/tmp/t=1.jsonl"])
    assert o == SessionOptions(0.25, 16, "lfu", 8, True, True, 3, "/tmp/t=1.jsonl")
    assert o.to_items() == ["moe_cpu_share=0.25", "expert_cache_slots=16", "expert_eviction=lfu", "n_threads=8",
                            "disk_experts=true", "cpu_moe=true", "n_cpu_moe=3", "trace_path=/tmp/t=1.jsonl"]


@pytest.mark.parametrize("text,value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("OFF", False)])
def test_bool_words(text, value):
    assert SessionOptions.parse([f"cpu_moe={text}"]).cpu_moe is value


@pytest.mark.parametrize("item,field_,value", [
    ("moe_cpu_share=auto", "moe_cpu_share", "auto"), ("moe_cpu_share=AUTO", "moe_cpu_share", "auto"),
    ("moe_cpu_share=1", "moe_cpu_share", 1.0), ("moe_cpu_share=1e-1", "moe_cpu_share", 0.1),
    ("moe_cpu_share=-0.0", "moe_cpu_share", 0.0), ("n_threads=none", "n_threads", None),
    ("n_threads=", "n_threads", None), (f"n_threads={MAXT}", "n_threads", MAXT), ("n_threads=+2", "n_threads", 2),
    ("flash_attn=auto", "flash_attn", "auto"), ("flash_attn=on", "flash_attn", True),
    ("devices=DEV1, DEV0", "devices", "DEV1,DEV0"), ("devices=none", "devices", None),
    ("n_threads_batch=2", "n_threads_batch", 2),
    ("trace_path=None", "trace_path", None), ("trace_path=", "trace_path", None),
    ("trace_path=./none", "trace_path", "./none"), ("expert_cache_slots=1000000", "expert_cache_slots", 10 ** 6)])
def test_parse_values(item, field_, value):
    got = getattr(SessionOptions.parse([item]), field_)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("make", [lambda: SessionOptions.parse(["moe_cpu_share=-0.0"]),
                                  lambda: SessionOptions.from_dict({"moe_cpu_share": -0.0}),
                                  lambda: SessionOptions(moe_cpu_share=-0.0)])
def test_negative_zero_share_is_folded(make):
    assert math.copysign(1.0, make().moe_cpu_share) == 1.0
    assert make().to_dict() == DEFAULT.to_dict() and repr(make()) == repr(DEFAULT)


def test_from_dict_typed_and_text_values():
    o = SessionOptions.from_dict({"moe_cpu_share": 1, "n_threads": "4", "cpu_moe": "on", "disk_experts": True,
                                  "trace_path": None, "expert_eviction": "lfu"})
    assert o == SessionOptions(moe_cpu_share=1.0, n_threads=4, cpu_moe=True, disk_experts=True, expert_eviction="lfu")
    assert type(o.moe_cpu_share) is float


def test_duplicates_with_same_value_accepted():
    assert SessionOptions.parse(["n_threads=2", "n_threads=2"]).n_threads == 2
    assert SessionOptions.parse(["cpu_moe=true", "cpu_moe=yes", "cpu_moe=1"]).cpu_moe is True
    assert SessionOptions.parse(["moe_cpu_share=0.5", "moe_cpu_share=.50"]).moe_cpu_share == 0.5
    assert SessionOptions.parse(["d.n_threads=3", "d.n_threads=03"], role="d").n_threads == 3
    assert SessionOptions.from_dict({"n_threads": 2, " n_threads": "2"}).n_threads == 2


# ---- roles and precedence ----------------------------------------------------------------------------

ITEMS = ["n_threads=2", "draft.n_threads=4", "draft.cpu_moe=true", "target.n_cpu_moe=5", "expert_eviction=lfu"]


def test_role_scoping():
    draft = SessionOptions.parse(ITEMS, role="draft")
    assert (draft.n_threads, draft.cpu_moe, draft.n_cpu_moe, draft.expert_eviction) == (4, True, 0, "lfu")
    target = SessionOptions.parse(ITEMS, role="target")
    assert (target.n_threads, target.cpu_moe, target.n_cpu_moe, target.expert_eviction) == (2, False, 5, "lfu")
    nobody = SessionOptions.parse(ITEMS)
    assert (nobody.n_threads, nobody.cpu_moe, nobody.n_cpu_moe) == (2, False, 0)


def test_role_specific_wins_regardless_of_order():
    assert SessionOptions.parse(["draft.n_threads=4", "n_threads=2"], role="draft").n_threads == 4
    assert SessionOptions.from_dict({"draft.n_threads": 4, "n_threads": 2}, role="draft").n_threads == 4


def test_precedence_base_bare_role_explicit():
    base = SessionOptions(n_threads=1, n_cpu_moe=9, expert_cache_slots=7)
    o = SessionOptions.parse(["n_threads=2", "n_cpu_moe=3", "draft.n_threads=4"], role="draft", base=base)
    assert (o.n_threads, o.n_cpu_moe, o.expert_cache_slots) == (4, 3, 7)  # role > bare > base
    m = o.merged(n_threads=8)
    assert (m.n_threads, m.n_cpu_moe, m.expert_cache_slots) == (8, 3, 7)  # explicit > everything
    assert o.n_threads == 4  # frozen: merged returns a copy
    d = SessionOptions.from_dict({"n_cpu_moe": 3, "draft.n_cpu_moe": "6"}, role="draft", base=base)
    assert (d.n_threads, d.n_cpu_moe) == (1, 6)


def test_merged_validates_and_parses():
    assert DEFAULT.merged(n_threads="2", trace_path="x").to_items() == ["n_threads=2", "trace_path=x"]
    assert DEFAULT.merged() == DEFAULT
    with pytest.raises(OptionError, match=rf"n_threads=0: must be an integer in 1\.\.{MAXT} \(4 x the cores\)"):
        DEFAULT.merged(n_threads=0)
    with pytest.raises(OptionError, match="did you mean 'cpu_moe'"):
        DEFAULT.merged(cpu_mo=True)


def test_other_roles_are_still_validated():
    with pytest.raises(OptionError, match="target.n_threads=0"):
        SessionOptions.parse(["target.n_threads=0"], role="draft")
    with pytest.raises(OptionError, match="unknown option 'n_thread'"):
        SessionOptions.parse(["target.n_thread=2"], role="draft")
    with pytest.raises(OptionError, match="given twice"):
        SessionOptions.from_dict({"x.cpu_moe": True, "x.cpu_moe ": False}, role="y")


# ---- every class of invalid input --------------------------------------------------------------------

BAD_ITEMS = [  # (items, role, fragments the message must contain)
    (["moe_cpu_share=1.5"], None, ["moe_cpu_share=1.5: must be a number in [0, 1] or 'auto'"]),
    (["moe_cpu_share=-0.1"], None, ["moe_cpu_share=-0.1", "[0, 1]"]),
    (["moe_cpu_share=nan"], None, ["moe_cpu_share=nan", "[0, 1]"]),
    (["moe_cpu_share=inf"], None, ["moe_cpu_share=inf", "[0, 1]"]),
    (["moe_cpu_share=-inf"], None, ["moe_cpu_share=-inf"]),
    (["moe_cpu_share=half"], None, ["moe_cpu_share=half", "'auto'"]),
    (["moe_cpu_share="], None, ["moe_cpu_share=:", "[0, 1]"]),
    (["n_threads=0"], None, ["n_threads=0", f"1..{MAXT}"]),
    ([f"n_threads={MAXT + 1}"], None, [f"n_threads={MAXT + 1}", f"1..{MAXT} (4 x the cores)"]),
    (["n_threads=512"], None, ["n_threads=512", f"1..{MAXT}"]),
    ([f"n_threads_batch={MAXT + 1}"], None, ["n_threads_batch", f"1..{MAXT}"]),
    (["devices=GPU0"], None, ["devices=GPU0", "'GPU0' is not a device name"]),
    (["devices=DEV0,DEV0"], None, ["devices=DEV0,DEV0", "each once"]),
    (["flash_attn=maybe"], None, ["flash_attn=maybe", "'auto'"]),
    (["n_threads=1.5"], None, ["n_threads=1.5", "integer"]),
    (["n_threads=1e3"], None, ["n_threads=1e3", "integer"]),
    (["n_threads=1_0"], None, ["n_threads=1_0", "integer"]),
    (["n_threads=four"], None, ["n_threads=four", "integer"]),
    (["expert_cache_slots=-1"], None, ["expert_cache_slots=-1", ">= 0"]),
    (["expert_cache_slots=none"], None, ["expert_cache_slots=none", ">= 0"]),
    (["n_cpu_moe=-3"], None, ["n_cpu_moe=-3", ">= 0"]),
    (["n_cpu_moe=" + "9" * 5000], None, ["n_cpu_moe=999", ">= 0"]),  # beyond int()'s digit limit
    (["expert_eviction=fifo"], None, ["expert_eviction=fifo", "'lru', 'lfu'"]),
    (["cpu_moe=maybe"], None, ["cpu_moe=maybe", "true/false"]),
    (["disk_experts=2"], None, ["disk_experts=2", "boolean"]),
    (["n_thread=4"], None, ["n_thread=4", "unknown option 'n_thread'", "did you mean 'n_threads'"]),
    (["expert_evict=lru"], None, ["unknown option", "did you mean 'expert_eviction'"]),
    (["zzzz=1"], None, ["zzzz=1", "unknown option 'zzzz'", "known options", "trace_path"]),
    (["draft.bogus=1"], "draft", ["draft.bogus=1", "unknown option 'bogus'"]),
    (["n_threads"], None, ["'n_threads'", "missing '='"]),
    (["draft.n_threads"], "draft", ["draft.n_threads", "missing '='"]),
    (["=4"], None, ["=4", "empty option name"]),
    ([" =4"], None, ["empty option name"]),
    (["draft.=4"], "draft", ["draft.=4", "empty option name"]),
    ([".n_threads=4"], None, [".n_threads=4", "role ''"]),
    (["1draft.n_threads=4"], None, ["1draft.n_threads=4", "role '1draft'", "[A-Za-z_]"]),
    (["a.b.n_threads=4"], None, ["a.b.n_threads=4", "role"]),
    (["dr aft.n_threads=4"], None, ["role 'dr aft'"]),
    (["n_threads=2", "n_threads=4"], None, ["n_threads given twice", "2 and 4"]),
    (["draft.n_threads=2", "draft.n_threads=4"], "draft", ["draft.n_threads given twice", "2 and 4"]),
    (["x.cpu_moe=on", "x.cpu_moe=off"], None, ["x.cpu_moe given twice", "on and off"]),
    (["moe_cpu_share=auto", "moe_cpu_share=0.5"], None, ["moe_cpu_share given twice", "auto and 0.5"]),
    ([], "bad role", ["role='bad role'"]),
    ([], "", ["role=''"]),
    ([4], None, ["4", "expected a 'key=value' string, got int"]),
    ("n_threads=4", None, ["not one string"]),
]


@pytest.mark.parametrize("items,role,fragments", BAD_ITEMS, ids=[repr(b[0])[:40] for b in BAD_ITEMS])
def test_parse_rejects(items, role, fragments):
    with pytest.raises(OptionError) as info:
        SessionOptions.parse(items, role=role)
    for fragment in fragments:
        assert fragment in str(info.value)


BAD_DICTS = [  # strict types for typed values, text parsed like parse()
    ({"n_threads": True}, ["n_threads=True", "got bool"]),
    ({"n_threads": 2.0}, ["n_threads=2.0", "got float"]),
    ({"expert_cache_slots": "1.5"}, ["expert_cache_slots=1.5", ">= 0"]),
    ({"n_cpu_moe": None}, ["n_cpu_moe=None", "got NoneType"]),
    ({"moe_cpu_share": True}, ["moe_cpu_share=True", "got bool"]),
    ({"moe_cpu_share": float("nan")}, ["moe_cpu_share=nan", "[0, 1]"]),
    ({"moe_cpu_share": 10 ** 400}, ["moe_cpu_share=", "[0, 1]"]),
    ({"moe_cpu_share": [0.5]}, ["got list"]),
    ({"cpu_moe": 1}, ["cpu_moe=1", "got int"]),
    ({"expert_eviction": 1}, ["expert_eviction=1", "got int"]),
    ({"trace_path": 3}, ["trace_path=3", "got int"]),
    ({"n_threads": 2, " n_threads": 4}, ["n_threads given twice"]),
    ({"n_treads": 2}, ["did you mean 'n_threads'"]),
    ({"": 2}, ["empty option name"]),
    ({3: 2}, ["option names must be strings"]),
    ({"-x.cpu_moe": True}, ["role '-x'"]),
]


@pytest.mark.parametrize("d,fragments", BAD_DICTS, ids=[repr(b[0])[:40] for b in BAD_DICTS])
def test_from_dict_rejects(d, fragments):
    with pytest.raises(OptionError) as info:
        SessionOptions.from_dict(d)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("call", [
    lambda: SessionOptions.from_dict([("n_threads", 2)]),
    lambda: SessionOptions.parse(5),
    lambda: SessionOptions.parse([], base={"n_threads": 2}),
    lambda: SessionOptions(n_threads="4"),
    lambda: SessionOptions(trace_path="none"),
    lambda: SessionOptions(trace_path=""),
    lambda: SessionOptions(expert_eviction="LRU"),
    lambda: SessionOptions(cpu_moe=1),
    lambda: SessionOptions(moe_cpu_share=2.0),
])
def test_bad_arguments_raise_option_error(call):
    with pytest.raises(OptionError):
        call()


def test_option_error_hierarchy():
    assert issubclass(OptionError, GgmlHybridError) and issubclass(OptionError, ValueError)


def test_nothing_partially_applied():
    base = SessionOptions(n_threads=3)
    with pytest.raises(OptionError):
        SessionOptions.parse(["n_threads=8", "cpu_moe=true", "n_cpu_moe=-1"], base=base)
    assert base == SessionOptions(n_threads=3)  # frozen, and no other object escaped
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.n_threads = 4


# ---- describe ----------------------------------------------------------------------------------------

def test_describe_covers_every_field():
    rows = SessionOptions.describe()
    assert [r[0] for r in rows] == NAMES and len(NAMES) == 38
    for name, type_, default, rule, doc in rows:
        assert default == getattr(DEFAULT, name)
        assert type_ and rule and doc.strip() and "\n" not in doc
    assert dict((r[0], r[4]) for r in rows)["expert_cache_slots"].count("0 = no cache, experts resident") == 1


# ---- hypothesis: round trips and junk ----------------------------------------------------------------

paths = st.text(min_size=1, max_size=20).filter(lambda s: s.lower() != "none")
options = st.builds(
    SessionOptions,
    moe_cpu_share=st.one_of(st.just("auto"), st.floats(0.0, 1.0)),
    expert_cache_slots=st.integers(0, 2 ** 40),
    expert_eviction=st.sampled_from(["freq", "lru", "lfu"]),
    n_threads=st.none() | st.integers(1, MAXT), n_threads_batch=st.none() | st.integers(1, MAXT),
    devices=st.none() | st.sampled_from(["DEV0", "DEV1,DEV0", "CUDA0,CUDA3"]),
    disk_experts=st.booleans(),
    cpu_moe=st.booleans(),
    n_cpu_moe=st.integers(0, 1000),
    trace_path=st.none() | paths,
    n_ctx=st.integers(0, 10 ** 6), n_parallel=st.integers(1, 256), batch_size=st.integers(1, 8192),
    ubatch_size=st.integers(1, 8192),
    cache_type_k=st.sampled_from(["f32", "f16", "q8_0"]), cache_type_v=st.sampled_from(["f32", "f16", "q8_0"]),
    flash_attn=st.sampled_from([True, False, "auto"]), n_gpu_layers=st.integers(-1, 200),
    override_tensor=st.none() | st.sampled_from(["exps=CPU", r"blk\.[0-3]\.ffn=DEV1,attn=DEV0", "(q|k)_norm=CPU"]),
    split_mode=st.sampled_from(["layer", "none"]), tensor_split=st.none() | st.sampled_from(["1,1", "3,1", "0.5,0,2"]),
    no_kv_offload=st.booleans(), check_tensors=st.booleans(), virtual_devices=st.integers(1, MAX_DEVICES),
    rpc=st.none() | st.sampled_from(["127.0.0.1:50052", "gpu-box:1,10.0.0.2:65535"]),
)


@given(options)
def test_round_trip_items(o):
    items = o.to_items()
    assert SessionOptions.parse(items) == o
    assert len(items) == sum(getattr(o, n) != getattr(DEFAULT, n) for n in NAMES)


@given(options)
def test_round_trip_dict(o):
    d = o.to_dict()
    assert list(d) == NAMES
    assert SessionOptions.from_dict(d) == o


@given(options, options)
def test_round_trip_as_role_over_base(o, base):
    scoped = [f"draft.{item}" for item in o.to_items()]
    got = SessionOptions.parse(scoped, role="draft", base=base)
    assert got == dataclasses.replace(base, **{n: getattr(o, n) for n in NAMES if getattr(o, n) != getattr(DEFAULT, n)})
    assert SessionOptions.parse(scoped, role="other", base=base) == base


keys = st.one_of(st.text(max_size=15), st.sampled_from(NAMES),
                 st.tuples(st.sampled_from(["draft", "x-1", "", "1a", "a b"]), st.sampled_from(NAMES + ["nope"]))
                 .map(".".join))
texts = st.one_of(st.text(max_size=15), st.sampled_from(["auto", "none", "", "nan", "inf", "1e3", "-1", "0", "1",
                                                         "513", "yes", "lfu", "0.5", " 2 ", "1_0"]))
junk_items = st.one_of(st.text(max_size=30), st.tuples(keys, texts).map("=".join))
values = st.one_of(texts, st.none(), st.booleans(), st.integers(), st.floats(), st.lists(st.integers(), max_size=2))


def _only_option_errors(call):
    try:
        result = call()
    except OptionError as e:
        assert str(e)
        return None
    assert isinstance(result, SessionOptions)
    return result


@given(st.lists(junk_items, max_size=5), st.one_of(st.none(), st.text(max_size=8)))
def test_junk_items_raise_only_option_error(items, role):
    o = _only_option_errors(lambda: SessionOptions.parse(items, role=role))
    if o is not None:  # whatever was accepted must survive its own round trip
        assert SessionOptions.parse(o.to_items()) == o


@given(st.dictionaries(keys, values, max_size=5), st.one_of(st.none(), st.sampled_from(["draft", "x-1"])))
def test_junk_dicts_raise_only_option_error(d, role):
    o = _only_option_errors(lambda: SessionOptions.from_dict(d, role=role))
    if o is not None:
        assert SessionOptions.from_dict(o.to_dict()) == o


@given(st.sampled_from(NAMES), values)
def test_junk_merged_raise_only_option_error(name, value):
    o = _only_option_errors(lambda: DEFAULT.merged(**{name: value}))
    if o is not None:
        assert o.merged(**{name: getattr(o, name)}) == o


def test_each_list_of_names_is_written_once():
    """An option whose value is one of a few names has one list of them, its Literal in options.py: the CLI's
    choices are read from it, and where C decides by the name (the eviction orders of the slot cache and the host
    tier) the C enum's names (enum hy_policy, through cffi) are the same names."""
    from typing import get_args

    from ggml_hybrid.cli.flags import SESSION_FLAGS
    from ggml_hybrid.moe.slot_cache import POLICIES, POLICY_CODES
    from ggml_hybrid.options import EvictionPolicy, KVCacheType, SplitMode

    assert sorted(get_args(EvictionPolicy)) == sorted(POLICIES) == sorted(POLICY_CODES)
    flags = {f.key: f for f in SESSION_FLAGS if f.key is not None}
    assert tuple(flags["expert_eviction"].kwargs["type"].choices) == get_args(EvictionPolicy)
    assert tuple(flags["cache_type_k"].kwargs["type"].choices) == get_args(KVCacheType)
    assert tuple(flags["cache_type_v"].kwargs["type"].choices) == get_args(KVCacheType)
    assert set(get_args(SplitMode)) <= set(flags["split_mode"].kwargs["type"].choices)
