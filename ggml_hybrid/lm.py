"""A MoE language model loaded from GGUF: weights placed per the session options, a KV cache, logits.

    with MoEModel("model.gguf", SessionOptions.parse(["moe_cpu_share=0.5", "disk_experts=1",
                                                      "expert_cache_slots=16"])) as m:
        logits = m.eval(m.tokenizer.encode("Hello"))   # [1, n_vocab]: the last position

Dense weights (attention, norms, routers, shared experts, embeddings, output)
go to the device; routed experts are placed by :class:`ExpertLayers` (resident,
``cpu_moe``/``n_cpu_moe``, or disk-backed with the expert cache and the hybrid
CPU share). One sequence: ``eval`` appends tokens to the KV cache, ``reset``
starts over.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .backend import Backend, cpu, cuda, cuda_available
from .errors import ShapeError
from .experts import ExpertLayers, check_moe_options
from .hparams import HParams, read_hparams, tensor_shapes
from .kv_cache import KVCache
from .lm_graph import DecoderGraph, build_decoder, graph_size
from .moe_session import SessionCounters
from .options import OptionError, SessionOptions
from .sched import Scheduler
from .store import GGUFStore, load_into
from .tokenizer import Tokenizer

DEFAULT_MAX_CTX = 4096
_EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def check_options(opts: SessionOptions, hp: HParams) -> None:
    check_moe_options(opts, hp.n_layer, hp.n_expert)
    if opts.ubatch_size > opts.batch_size:
        raise OptionError(f"ubatch_size={opts.ubatch_size}: must not exceed batch_size={opts.batch_size}")
    if opts.n_ctx > hp.n_ctx_train:
        raise OptionError(f"n_ctx={opts.n_ctx}: the model was trained for at most {hp.n_ctx_train} tokens")
    if opts.cache_type_v == "q8_0" and not opts.flash_attn:
        raise OptionError("cache_type_v=q8_0: a quantized V cache needs flash_attn=true (as in llama.cpp)")
    for key in ("cache_type_k", "cache_type_v"):
        if getattr(opts, key) == "q8_0" and hp.head_dim % 32:
            raise OptionError(f"{key}=q8_0: the head size {hp.head_dim} is not a multiple of 32")


class MoEModel:
    def __init__(self, path, options: SessionOptions | None = None, device: Backend | None = None,
                 progress=None):
        """Load ``path``; ``progress(done, total)`` is called as tensors are loaded."""
        t0 = time.perf_counter()
        self.options = opts = options if options is not None else SessionOptions()
        if not isinstance(opts, SessionOptions):
            raise OptionError(f"options must be SessionOptions, got {type(opts).__name__}")
        self.store = store = GGUFStore(path)
        try:
            self.hp = hp = read_hparams(store)
            check_options(opts, hp)
            self.tokenizer = Tokenizer.from_gguf(store)
        except Exception:
            store.close()
            raise
        n_threads = opts.n_threads or os.cpu_count() or 1
        self._own_device = device is None
        # without an accelerator a CPU backend instance plays the device, with its own buffers
        self.device = device or (cuda(0) if cuda_available() else cpu(n_threads))
        self.host = cpu(n_threads)
        self.sched = Scheduler([self.device, self.host], graph_size=2 * graph_size(hp))
        dense = [n for n in tensor_shapes(hp) if not n.endswith(_EXPERT_SUFFIXES)]
        total = len(dense) + 3 * hp.n_layer
        done = [0]

        def tick(_name):
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

        self.dense_ctx, self.weights = load_into(store, dense, self.device, on_tensor=tick)
        self.experts = ExpertLayers(store, hp.n_layer, hp.n_used, opts, self.device, n_threads, on_tensor=tick)
        n_ctx = opts.n_ctx or min(hp.n_ctx_train, DEFAULT_MAX_CTX)
        self.kv = KVCache(hp.n_layer, n_ctx, hp.n_embd_kv, opts.cache_type_k, opts.cache_type_v, self.device,
                          v_trans=not opts.flash_attn)
        self._graphs: dict[tuple, DecoderGraph] = {}
        self._active: tuple | None = None  # key of the graph whose regions are registered
        self.load_seconds = time.perf_counter() - t0

    # -- state ----------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    def reset(self) -> None:
        """Forget the sequence: the next eval starts at position 0."""
        self.kv.clear()

    # -- evaluation -----------------------------------------------------------

    def _graph(self, n_tokens: int, n_kv: int, n_out: int) -> DecoderGraph:
        key = (n_tokens, n_kv, n_out)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = build_decoder(self.hp, self.weights, self.experts.weights, self.kv,
                                                      n_tokens, n_kv, n_out, self.options.flash_attn)
        if self._active != key:
            self.sched.clear_regions()
            self.experts.register(self.sched, entry.regions)
            self._active = key
        return entry

    def _check_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ShapeError(f"eval: tokens must be a non-empty 1-D sequence of integers, got {arr.dtype} "
                             f"{arr.shape}")
        bad = (arr < 0) | (arr >= self.hp.n_vocab)
        if bad.any():
            raise ValueError(f"eval: token id {int(arr[bad][0])} is outside the vocabulary 0..{self.hp.n_vocab - 1}")
        return arr.astype(np.int32)

    def _ubatch(self, tokens: np.ndarray, n_out: int) -> np.ndarray:
        n = len(tokens)
        n_kv = self.kv.n_kv_for(n)
        g = self._graph(n, n_kv, n_out)
        self.sched.prepare(g.graph)
        feed = self.kv.inputs(n, n_kv, np.float16 if self.options.flash_attn else np.float32)
        feed["tokens"] = tokens
        if "out_ids" in g.inputs:
            feed["out_ids"] = np.arange(n - n_out, n, dtype=np.int32)
        # every input was built here from checked tokens and the cache's own positions
        for name, t in g.inputs.items():
            t._set_trusted(feed[name])
        self.sched.compute(g.graph)
        self.kv.n_past += n
        return g.logits.numpy().reshape(n_out, self.hp.n_vocab)

    def eval(self, tokens, logits: str = "last") -> np.ndarray:
        """Append ``tokens`` to the sequence; the logits of the last (``"last"``) or every (``"all"``) one."""
        if logits not in ("last", "all"):
            raise ValueError(f"eval: logits={logits!r} must be 'last' or 'all'")
        arr = self._check_tokens(tokens)
        self.kv.n_kv_for(len(arr))  # the whole call fits, or nothing is evaluated
        ub = self.options.ubatch_size
        out = []
        for b0 in range(0, len(arr), self.options.batch_size):
            batch = arr[b0:b0 + self.options.batch_size]
            for u0 in range(0, len(batch), ub):
                part = batch[u0:u0 + ub]
                last = b0 + u0 + len(part) == len(arr)
                if logits == "all":
                    out.append(self._ubatch(part, len(part)))
                elif last:
                    out.append(self._ubatch(part, 1))
                else:
                    self._ubatch(part, 1)  # the logits of a prompt's inner positions are not needed
        return np.concatenate(out, axis=0)

    # -- reporting ------------------------------------------------------------

    @property
    def counters(self) -> SessionCounters:
        return SessionCounters(self.experts.counters)

    def device_memory(self) -> dict[str, int]:
        """Bytes on the device by purpose (what a GPU would hold)."""
        return {"weights": sum(t.nbytes for t in self.dense_ctx.tensors()), "experts": self.experts.device_bytes,
                "kv_cache": self.kv.nbytes, "compute": self.sched.buffer_size(self.device)}

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        if self.sched is None:
            return
        self.experts.close()
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        self.sched.close()
        self.kv.close()
        self.dense_ctx.close()
        self.store.close()
        self.host.close()
        if self._own_device:
            self.device.close()
        self.sched = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["MoEModel", "check_options"]
