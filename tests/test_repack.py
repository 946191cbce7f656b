"""Repacked CPU weights (GGML's CPU extra buffer types, llama.cpp's default): patch 0004's one-expert writes, which
weights qualify (GGML's rule, checked against the decoder graphs), every mode bit-identical to resident with them,
llama.cpp's logits only with them, ``repack=false``, and the memory they take."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid._native import cstr, ffi, lib
from ggml_hybrid.errors import BackendError
from ggml_hybrid.ggml.quant import quantize
from ggml_hybrid.ggml.repack import buffer_type_name, extra_buffer_types, repack_buffer_type
from ggml_hybrid.gguf.names import weight_op
from ggml_hybrid.model.decoder import SeqRows
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model

HERE = os.path.dirname(os.path.abspath(__file__))
# the types GGML repacks on this CPU (AVX2: Q4_0, Q4_K, IQ4_NL, MXFP4; ARM and AVX-512 differ)
REPACKED = [t for t in ("q4_0", "q4_K", "iq4_nl") if repack_buffer_type(t, (4, 16, 256), "mul_mat_id") is not None]
needs_repack = pytest.mark.skipif(not REPACKED, reason="GGML repacks none of Q4_0, Q4_K, IQ4_NL on this CPU")
Q4 = dict(arch="qwen3moe", n_embd=256, n_ff_exp=256, n_head=2, n_head_kv=1, head_dim=128)


def _raw(t) -> bytes:
    """The bytes of a tensor's memory (a repacked buffer is host memory GGML cannot read back)."""
    return bytes(ffi.buffer(t.ptr.data, t.nbytes))


# -- patch 0004: one expert at a time ------------------------------------------------------------------------


@needs_repack
@pytest.mark.parametrize("dtype", REPACKED)
def test_expert_slices_repack_to_the_bytes_of_a_whole_write(dtype):
    n_expert, rows, k = 6, 16, 256
    rng = np.random.default_rng(1)
    raw = quantize(rng.standard_normal((n_expert, rows, k)).astype(np.float32), dtype)
    buft = repack_buffer_type(dtype, (n_expert, rows, k), "mul_mat_id")
    with gh.Context(n_tensors=4) as ctx:
        whole, sliced = ctx.new_tensor(dtype, (n_expert, rows, k)), ctx.new_tensor(dtype, (n_expert, rows, k))
        ctx.allocate_group([whole], buft, "weights")
        ctx.allocate_group([sliced], buft, "weights")
        assert lib.ggml_backend_buffer_get_type(whole.ptr.buffer) == buft
        whole.set(raw.reshape(-1))
        nb2 = int(sliced.nb[2])
        src = ffi.from_buffer(raw)
        # one expert at a time in another order, then two at once (a write of several whole slices)
        for e in (4, 1, 5, 0):
            lib.ggml_backend_tensor_set(sliced.ptr, src + e * nb2, e * nb2, nb2)
        lib.ggml_backend_tensor_set(sliced.ptr, src + 2 * nb2, 2 * nb2, 2 * nb2)
        assert _raw(sliced) == _raw(whole)
        assert _raw(whole) != raw.tobytes()  # really repacked, not copied
        # an expert written again (a slot reused) is that expert's bytes
        lib.ggml_backend_tensor_set(sliced.ptr, src + 5 * nb2, 0, nb2)
        assert _raw(sliced)[:nb2] == _raw(whole)[5 * nb2:6 * nb2]


@needs_repack
def test_repacked_products_equal_on_slice_written_experts():
    dtype = REPACKED[0]
    n_expert, rows, k = 4, 8, 256
    rng = np.random.default_rng(2)
    raw = quantize(rng.standard_normal((n_expert, rows, k)).astype(np.float32), dtype)
    x = rng.standard_normal((3, 1, k)).astype(np.float32)
    ids = np.array([[2], [0], [3]], np.int32)
    backend = gh.cpu(1)
    outs = []
    for sliced in (False, True):
        with gh.Context(n_tensors=8, graph_size=16) as ctx:
            w = ctx.new_tensor(dtype, (n_expert, rows, k))
            ctx.allocate_group([w], repack_buffer_type(dtype, w.shape, "mul_mat_id"), "weights")
            if sliced:
                nb2 = int(w.nb[2])
                for e in range(n_expert):
                    lib.ggml_backend_tensor_set(w.ptr, ffi.from_buffer(raw) + e * nb2, e * nb2, nb2)
            else:
                w.set(raw.reshape(-1))
            xt, it = ctx.new_tensor("f32", x.shape), ctx.new_tensor("i32", ids.shape)
            out = ctx.mul_mat_id(w, xt, it)
            g = ctx.new_graph(16).expand(out)
            ctx.allocate(backend)
            xt.set(x)
            it.set(ids)
            lib.ggml_backend_graph_compute(backend.ptr, g.ptr)
            outs.append(out.numpy())
    backend.close()
    assert np.array_equal(outs[0], outs[1])
    # and the product is the experts' product (float64 over GGML's own dequantized weights)
    deq = gh.dequantize(raw.reshape(n_expert * rows, -1), dtype, k).reshape(n_expert, rows, k).astype(np.float64)
    want = np.stack([deq[ids[t, 0]] @ x[t, 0] for t in range(3)])
    assert np.allclose(outs[0].reshape(3, rows), want, atol=0.05 * np.abs(want).max())


def _repacked_mul_mat(dtype: str, raw: np.ndarray, x: np.ndarray, rowwise: bool) -> np.ndarray:
    """``raw`` (rows x k, quantized) in the repacked buffer times the rows of ``x``, on one CPU thread."""
    rows = raw.shape[0]
    k = x.shape[1]
    backend = gh.cpu(1)
    with gh.Context(n_tensors=8, graph_size=16) as ctx:
        w = ctx.new_tensor(dtype, (rows, k))
        ctx.allocate_group([w], repack_buffer_type(dtype, w.shape, "mul_mat"), "weights")
        w.set(raw.reshape(-1))
        xt = ctx.new_tensor("f32", x.shape)
        out = ctx.mul_mat(w, xt)
        if rowwise:
            lib.ggml_mul_mat_set_hint(out.ptr, lib.GGML_HINT_ROWWISE)
        g = ctx.new_graph(16).expand(out)
        ctx.allocate(backend)
        xt.set(x)
        lib.ggml_backend_graph_compute(backend.ptr, g.ptr)
        got = out.numpy().reshape(x.shape[0], rows)
    backend.close()
    return got


@needs_repack
@pytest.mark.parametrize("dtype", REPACKED)
def test_rowwise_repacked_products_equal_one_row_products(dtype):
    """Patch 0006: a rowwise product over repacked weights gives every row its one-row product's bits (gemv),
    whatever the batch; without the hint 4+ rows take gemm, which rounds differently for some of them."""
    rng = np.random.default_rng(5)
    rows, k, n = 512, 512, 9  # 288-byte rows: the rowwise path reads them in blocks of 224, 224 and 64 columns
    raw = quantize(rng.standard_normal((rows, k)).astype(np.float32), dtype)
    x = rng.standard_normal((n, k)).astype(np.float32)
    many = _repacked_mul_mat(dtype, raw, x, rowwise=True)
    plain = _repacked_mul_mat(dtype, raw, x, rowwise=False)
    ones = np.concatenate([_repacked_mul_mat(dtype, raw, x[i:i + 1], rowwise=False) for i in range(n)])
    assert many.tobytes() == ones.tobytes()
    assert np.array_equal(plain[8:], ones[8:])  # the ninth row is gemv's in both
    deq = gh.dequantize(raw, dtype, k).astype(np.float64)
    assert np.allclose(plain, x.astype(np.float64) @ deq.T, rtol=0, atol=0.02 * np.abs(ones).max())
    if dtype == "q4_K":  # measured: Q4_K's gemm rounds its rows differently (why a hint is needed at all)
        assert plain[:8].tobytes() != ones[:8].tobytes()


@needs_repack
def test_repacked_tensors_are_not_read_back():
    dtype = REPACKED[0]
    with gh.Context(n_tensors=2) as ctx:
        w = ctx.new_tensor(dtype, (2, 8, 256))
        ctx.allocate_group([w], repack_buffer_type(dtype, w.shape, "mul_mat_id"), "weights")
        with pytest.raises(BackendError, match="repacked"):
            w.numpy()


# -- which weights -----------------------------------------------------------------------------------------------


def test_which_weights_ggml_repacks():
    assert repack_buffer_type("f32", (8, 256), "mul_mat") is None
    assert repack_buffer_type("f16", (8, 16, 256), "mul_mat_id") is None
    for dtype in REPACKED:
        assert buffer_type_name(repack_buffer_type(dtype, (16, 256), "mul_mat")) == "CPU_REPACK"
        assert repack_buffer_type(dtype, (16, 256), "get_rows") is None  # the embeddings
        assert repack_buffer_type(dtype, (16, 256), None) is None
        assert repack_buffer_type(dtype, (12, 256), "mul_mat") is None  # rows not a multiple of 8
        assert repack_buffer_type(dtype, (2, 16, 256), "mul_mat") is None  # a batched product
    assert [buffer_type_name(b) for b in extra_buffer_types()][-1:] == (["CPU_REPACK"] if REPACKED else [])
    assert weight_op("token_embd.weight", 2) == "get_rows"
    assert weight_op("blk.3.ffn_gate_exps.weight", 3) == "mul_mat_id"
    assert weight_op("blk.3.ffn_gate_exps.bias", 2) is None
    assert weight_op("blk.0.attn_q.weight", 2) == "mul_mat"
    assert weight_op("blk.0.attn_norm.weight", 1) is None
    assert weight_op("blk.0.attn_k_b.weight", 3) is None  # deepseek2's batched product


FAMILIES = {
    "qwen3moe": dict(Q4),
    "qwen2moe": dict(arch="qwen2moe", n_embd=256, n_ff_exp=256, n_head=2, n_head_kv=1, head_dim=128),
    "glm4moe": dict(arch="glm4moe", n_layer=3, n_dense_lead=1, n_embd=256, n_ff_exp=256, n_head=2, n_head_kv=1,
                    head_dim=128, n_rot=64, gating="sigmoid", weights_scale=2.5, n_group=1, n_group_used=1),
    "gpt-oss": dict(arch="gpt-oss", n_layer=2, n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2, head_dim=64,
                    expert_type="mxfp4", n_swa=4),
    # hybrid families: the gated delta-net's weights used by other ops (convolution, norms) stay as they are
    "qwen35moe": dict(arch="qwen35moe", n_layer=4, n_rot=8, attn_interval=2, n_embd=256, n_ff_exp=256),
    "qwen3next": dict(arch="qwen3next", n_layer=4, n_rot=8, attn_interval=2, n_embd=256, n_ff_exp=256),
}


@needs_repack
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_repacked_weights_are_exactly_the_products_matrices(tmp_path, family):
    """What ``weight_op`` and GGML decide equals llama.cpp's rule on the real graph: a weight is repacked iff every
    node that uses it is a 2-D product (mul_mat) or an expert product (mul_mat_id) with it as the matrix, and GGML
    has a repacked kernel for its type and shape."""
    path = write_model(tmp_path / "m.gguf", ModelSpec(**FAMILIES[family], weight_type=REPACKED[0], seed=5))
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=64, n_gpu_layers=0)) as m:
        g = m._graph((SeqRows(0, 4, 64),), 4)
        weights = {int(ffi.cast("uintptr_t", t.ptr)): name for name, t in m.weights.items()}
        for ew in m.experts.weights:
            if ew is not None:
                weights.update({int(ffi.cast("uintptr_t", t.ptr)): t.name for t in ew.kinds.values()})
        uses: dict[str, list[tuple[str, int, int]]] = {n: [] for n in weights.values()}
        for node in g.graph.nodes:
            for i, src in enumerate(node.src):
                name = weights.get(int(ffi.cast("uintptr_t", src.ptr)))
                if name is not None:
                    uses[name].append((node.op, i, src.ndim))
        repacked = m.repacked | m.experts.repacked
        for name, used in uses.items():
            info = m.store.info(name)
            product = bool(used) and all((op, i, nd) in (("MUL_MAT", 0, 2), ("MUL_MAT_ID", 0, 3))
                                         for op, i, nd in used)
            kernel = repack_buffer_type(info.dtype, info.shape, "mul_mat_id" if len(info.shape) == 3 else "mul_mat")
            assert (name in repacked) == (product and kernel is not None), (name, used)
        assert repacked  # the model has repacked weights at all


@pytest.mark.parametrize("wtype", ["q8_0", "f16", *REPACKED[:1]])
def test_a_cpu_devices_weights_are_the_mapping_unless_repacked(tmp_path, wtype):
    """A CPU instance playing the device computes from the memory-mapped file's bytes, in place, as llama.cpp's mmap
    does for every CPU buffer (a copy in this process's memory gets 4 KiB pages where the page cache maps the file
    with huge pages: Q8_0 decode ran 10-20% slower, docs/benchmarks.md section 23); only repacked weights are
    copies. Dense weights and resident experts alike; the outputs are those of the copies (bit for bit, the
    llama.cpp fixtures of test_families)."""
    path = write_model(tmp_path / "m.gguf", ModelSpec(**Q4, weight_type=wtype, seed=8))
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=64)) as m:
        assert m.device.is_cpu
        base, size = int(m.store._map.ctypes.data), m.store._map.nbytes
        tensors = dict(m.weights)
        for ew in m.experts.weights:
            if ew is not None:
                tensors.update({t.name: t for t in ew.kinds.values()})
        repacked = m.repacked | m.experts.repacked
        placed = {name: base <= int(ffi.cast("uintptr_t", t.ptr.data)) < base + size for name, t in tensors.items()}
        assert any(placed.values())
        for name, in_mapping in placed.items():
            assert in_mapping == (name not in repacked), name


# -- every mode bit-identical to resident, and llama.cpp's logits ---------------------------------------------


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    if not REPACKED:
        pytest.skip("no repacked type on this CPU")
    return write_model(tmp_path_factory.mktemp("repack") / "q4.gguf", ModelSpec(**Q4, weight_type=REPACKED[0],
                                                                                seed=21))


def _logits(path, opts):
    with MoEModel(path, opts) as m:
        a = m.eval(list(range(1, 12)), "all")
        b = np.concatenate([m.eval([t], "all") for t in (5, 9, 17, 3)])
        slots = {b.name for e in m.experts.executors if e is not None for b in e.buffers}
        return (np.concatenate([a, b]), m.repacked | m.experts.repacked, m.experts.host_copies, m.layout_report(),
                slots)


MODES = {
    "cpu_moe": ["cpu_moe=true"], "n_cpu_moe": ["n_cpu_moe=1"], "ngl0": ["n_gpu_layers=0"],
    "cache": ["disk_experts=1", "expert_cache_slots=3"],
    "hybrid": ["disk_experts=1", "expert_cache_slots=3", "moe_cpu_share=0.5"],
    "all_cpu": ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=1"],
    "hybrid_python": ["disk_experts=1", "expert_cache_slots=3", "moe_cpu_share=0.5", "moe_executor=python"],
    "threads_batch": ["n_threads_batch=2"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_is_bit_identical_to_resident_with_repacked_weights(q4_model, mode):
    base = ["n_threads=1", "n_ctx=64", "ubatch_size=5"]
    ref, ref_repacked, _, _, _ = _logits(q4_model, SessionOptions.parse(base))
    got, repacked, host, report, slots = _logits(q4_model, SessionOptions.parse(base + MODES[mode]))
    assert np.array_equal(got, ref)
    experts = {n for n in ref_repacked if "_exps" in n}
    dense = ref_repacked - experts
    assert experts and dense and dense <= repacked  # the dense matrices repacked wherever they are
    disk = "disk_experts=1" in MODES[mode]
    assert (slots == {"CPU_REPACK"}) == disk  # a CPU device's cache slots: repacked, one expert per load
    if disk and "moe_cpu_share=0.5" not in MODES[mode] and "moe_cpu_share=1" not in MODES[mode]:
        assert not host  # no CPU share: the host experts are never computed, and stay on the mapping
    elif mode in ("cpu_moe", "ngl0") or disk:
        assert experts <= host  # on the host: copies in RAM
        assert report["tensors"]["CPU"]["routed_experts"] > 0
    else:
        assert experts <= repacked


def test_no_repack_is_the_plain_kernels(q4_model):
    base = ["n_threads=1", "n_ctx=64"]
    ref, repacked, _, _, _ = _logits(q4_model, SessionOptions.parse(base))
    plain, none, host, report, _ = _logits(q4_model, SessionOptions.parse(base + ["repack=false"]))
    assert repacked and not none and not host
    assert not np.array_equal(plain, ref)  # the repacked kernels round differently: the option matters
    assert np.allclose(plain, ref, atol=2e-2 * np.abs(ref).max())
    cpu, _, host, report, _ = _logits(q4_model, SessionOptions.parse(base + ["repack=false", "cpu_moe=true"]))
    assert np.array_equal(cpu, plain) and not host and "CPU" not in report["tensors"]


@pytest.mark.parametrize("name", ["qwen3moe_q4_0_ubatch5", "qwen3moe_q4_K"])
def test_llama_cpp_logits_need_the_repacked_weights(tmp_path, name):
    from make_reference_fixtures import load_for_cpu

    z, exact = load_for_cpu(os.path.join(HERE, "fixtures", "llama_ref", f"{name}.npz"))
    spec = ModelSpec(**json.loads(str(z["spec"])))
    if spec.weight_type not in REPACKED:
        pytest.skip(f"GGML does not repack {spec.weight_type} on this CPU")
    path = write_model(tmp_path / "m.gguf", spec)
    got = {}
    for repack in (True, False):
        with MoEModel(path, SessionOptions(n_threads=1, n_ctx=512, ubatch_size=int(z["ubatch"]), repack=repack)) as m:
            got[repack] = m.eval(z["tokens"], "all")
    if exact:  # llama.cpp's logits on a CPU with this one's SIMD features
        assert np.array_equal(got[True], z["logits"])
    assert not np.allclose(got[False], z["logits"], rtol=0, atol=1e-4 * np.abs(z["logits"]).max())


def test_repacked_fixtures_cover_q4_0_and_q4_K():
    names = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(HERE, "fixtures", "llama_ref", "*.npz"))}
    assert {"qwen3moe_q4_0", "qwen3moe_q4_0_ubatch5", "qwen3moe_q4_K", "qwen3moe_q4_K_ubatch5"} <= names


# -- memory --------------------------------------------------------------------------------------------------


def test_planner_counts_repacked_copies_in_host_memory(q4_model):
    opts = SessionOptions(n_threads=1, n_ctx=64, cpu_moe=True)
    p = plan(q4_model, opts)
    with MoEModel(q4_model, opts) as m:
        report = m.layout_report()["tensors"]
        copies = sum(t.nbytes for t in m.experts.mapped_ctx.tensors() if t.name in m.experts.host_copies)
    assert p.host.repacked == report["CPU"] and p.host.repacked_total == copies > 0
    assert p.host.mapped == report.get("mapped", {})
    assert p.host.resident_total >= copies
    off = plan(q4_model, opts.merged(repack=False))
    assert off.host.repacked_total == 0
    assert off.host.mapped_total == p.host.mapped_total + copies


def test_disk_experts_stay_mapped_when_their_copies_would_not_fit(q4_model, monkeypatch):
    import ggml_hybrid.moe.expert_layers as el

    items = ["n_threads=1", "n_ctx=64", "disk_experts=1", "expert_cache_slots=3", "moe_cpu_share=0.5"]
    ref, _, _, _, _ = _logits(q4_model, SessionOptions.parse(["n_threads=1", "n_ctx=64"]))
    monkeypatch.setattr(el, "available_memory", lambda: 1 << 20)
    got, repacked, host, report, slots = _logits(q4_model, SessionOptions.parse(items))
    assert not host and "CPU" not in report["tensors"]
    assert {n for n in repacked if "_exps" in n} == set() and slots == {"CPU_REPACK"}  # the slots are
    # the worker's rows come from the plain kernels: close to the repacked path, not its bits
    assert np.allclose(got, ref, atol=2e-2 * np.abs(ref).max())
    monkeypatch.setattr(el, "available_memory", lambda: None)  # unknown: not copied either
    _, _, host, _, _ = _logits(q4_model, SessionOptions.parse(items))
    assert not host


# -- the native CPU worker on repacked and mapped experts ----------------------------------------------------


@pytest.mark.parametrize("repack", [True, False])
def test_native_worker_rows_equal_mul_mat_id(tmp_path, repack):
    """The worker's job (one token's experts: the decode path, x quantized once; rows of several tokens)
    equals GGML's mul_mat_id over the same experts, repacked or used in place from the mapping."""
    from ggml_hybrid.ggml.ops import GLU_OPS
    from ggml_hybrid.gguf.store import GGUFStore, load_into, repack_rule
    from ggml_hybrid.moe.cpu_worker import NativeWorker
    from ggml_hybrid.moe.ffn import ExpertWeights, expert_ffn
    from ggml_hybrid.synthetic import write_moe_stack

    dtype = REPACKED[0] if REPACKED else "q8_0"
    path = write_moe_stack(tmp_path / "s.gguf", n_layer=1, n_embd=256, n_ff=256, n_expert=8, n_used=4,
                           expert_type=dtype, seed=3)
    store = GGUFStore(path)
    names = [f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
    ctx, tensors = load_into(store, names, None, repack=repack_rule(store, repack))
    experts = ExpertWeights(**{k: tensors[n] for k, n in zip(("gate", "up", "down"), names)})
    kinds = {cstr(lib.ggml_backend_buffer_name(t.ptr.buffer)) for t in experts.kinds.values()}
    assert kinds == ({"CPU_REPACK"} if repack and REPACKED else {"CPU_Mapped"})
    worker, backend = NativeWorker(1), gh.cpu(1)
    w = ffi.new("hy_experts *")
    for k, t in experts.kinds.items():
        setattr(w, k, t.ptr)
    rng = np.random.default_rng(4)
    try:
        for x, ids in [(np.repeat(rng.standard_normal((1, 256)), 3, 0), np.array([5, 0, 2])),  # one token
                       (rng.standard_normal((4, 256)), np.array([1, 1, 7, 3]))]:  # several
            x, ids = x.astype(np.float32), ids.astype(np.int32)
            out = np.empty_like(x)
            job = ffi.new("hy_job *")
            job.w, job.key, job.glu = w, w, GLU_OPS["swiglu"]
            job.n_expert, job.n_embd, job.n = 8, 256, len(ids)
            job.x, job.ids = ffi.cast("const float *", ffi.from_buffer(x)), ffi.cast("const int32_t *",
                                                                                     ffi.from_buffer(ids))
            job.out = ffi.cast("float *", ffi.from_buffer(out))
            lib.hy_worker_submit(worker.ptr, job)
            assert lib.hy_worker_wait(worker.ptr) == lib.HY_OK
            want = []
            for row, e in zip(x, ids):  # the resident graph's shape: one token, one expert at a time
                with gh.Context(n_tensors=16, graph_size=32) as g:
                    xin, it = g.new_tensor("f32", (1, 1, 256)), g.new_tensor("i32", (1, 1))
                    down = expert_ffn(g, experts, xin, it)
                    graph = g.new_graph(32).expand(down)
                    g.allocate(backend)
                    xin.set(row.reshape(1, 1, 256))
                    it.set(np.array([[e]], np.int32))
                    lib.ggml_backend_graph_compute(backend.ptr, graph.ptr)
                    want.append(down.numpy().reshape(256))
            assert np.array_equal(out, np.stack(want))
    finally:
        worker.close()
        backend.close()
        ctx.close()
        store.close()
