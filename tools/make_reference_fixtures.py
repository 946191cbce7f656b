#!/usr/bin/env python3
"""Record llama.cpp's logits and token ids for small generated models as test fixtures.

    python tools/make_reference_fixtures.py --llama-python /path/to/venv/bin/python [--out tests/fixtures/llama_ref]

The interpreter given must have ``llama-cpp-python==0.3.36`` (see docs/models.md).
Each case becomes ``CASE.npz``: the model spec (JSON), the session options both
sides ran with (flash attention, KV cache types; the ubatch size), the sha256 of
the file the generator wrote, the prompt tokens, llama.cpp's float32 logits of
every position and those of a context that outputs the last position only, and
llama.cpp's ids (and ``llama_detokenize`` text) for the tokenizer texts. Tests
regenerate the model from the spec, check the hash, and compare without
building llama.cpp.

Logits on several CPUs. GGML's native build picks its kernels by the CPU's SIMD
features, so llama.cpp's logits are exact for one feature set: ``simd_tag()``,
the features of ``SIMD_FLAGS`` the CPU has (``GGML_HYBRID_SIMD_TAG`` overrides it).
``CASE.npz`` (the base) holds the logits of the CPU named in its ``simd`` key
(AVX2: "ssse3 avx avx2 fma f16c"); ``simd/TAG/CASE.npz`` (TAG: a tag's features
joined by "-") holds another tag's: ``simd``, a copy of the base's inputs
(``sha256``, ``tokens``), and ``xor_KEY`` for each logits key (``logits``,
``last_logits``, ``decode_logits``): the uint32 XOR of the two recordings' float32
bits, exact and a few KB compressed. ``load_for_cpu`` gives a test the logits of
this CPU's tag and whether it has them (bit-identity), else the base's (a tolerance).

To add a tag, run this tool on a CPU with it: where ``CASE.npz`` exists with
another tag and the same inputs (spec, file hash, tokens, texts, options) it
writes ``simd/TAG/CASE.npz`` and leaves the base as it is; a case whose inputs
changed (or that has no base) is recorded as the base, and its old variants are
removed (rerun the tool on their CPUs). ``tools/make_converted_fixtures.py
--logits-only`` does the same for the converted files, and
``tools/simd_differences.py`` measures the new tag against the base (what the
tests' bounds for an unknown tag are set from; docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

import click
import numpy as np

from ggml_hybrid.synthetic import ModelSpec, write_model

PROMPT = "Hello, world! The quick brown fox jumps over the lazy dog."
TEXTS = ["Hello, world! The quick brown fox", "It's 2026-11-29; naïve café 東京   x\n\ny 12345678",
         "  leading spaces and  ĞÜ don't\tWE'LL", "def forward(x): return x + 3.14159  # ok", "",
         "MiXeD CaSe ÀÉÎõü ÄÖÜäöü HTTPServer DÉJÀ vu", "<|channel|>final<|message|>hi<|end|>",
         "日本語のテキスト、カタカナ！ 12345", "a<tool>b <tool> c x</s>y"]


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    ubatch: int = 512
    options: dict = field(default_factory=dict)  # SessionOptions items: flash_attn, cache_type_k/v, repack
    decode_from: int = 0   # also record a prompt of this many tokens followed by one decode call per token
    texts: tuple[str, ...] = ()  # tokenizer texts beyond TEXTS


def _s(**kw) -> ModelSpec:
    return ModelSpec(**kw)


_GLM = dict(arch="glm4moe", n_layer=3, n_dense_lead=1, n_rot=16, gating="sigmoid", weights_scale=2.5, n_group=1,
            n_group_used=1)
_DS_V3 = dict(arch="deepseek2", n_layer=3, n_dense_lead=1, n_expert=16, n_used=4, gating="sigmoid",
              weights_scale=2.5, n_group=4, n_group_used=2, rope_scaling="yarn", rope_factor=40.0, rope_orig_ctx=512,
              yarn_log_mul=0.1)
_OSS = dict(arch="gpt-oss", n_layer=4, head_dim=32, rope_scaling="yarn", rope_factor=8.0, rope_orig_ctx=256, n_swa=8,
            rope_freq_base=150000.0)
_Q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": True}
# recurrent models: 4 layers (attention every 2nd), 2 key and 4 value heads of the delta rule, partial rope
_NEXT = dict(arch="qwen3next", n_layer=4, n_rot=8, attn_interval=2)
_Q35 = dict(arch="qwen35moe", n_layer=4, n_rot=8, attn_interval=2)
# combining marks: qwen35's pre-tokenizer keeps them with their letters, qwen2's does not
_MARKS = ("cafe\u0301 nai\u0308ve  e\u0301te\u0301 \u0915\u093f\u0924\u093e\u092c",)
_Q4 = dict(arch="qwen3moe", n_embd=256, n_ff_exp=256, n_head=2, n_head_kv=1, head_dim=128)  # K-quant rows: 256

# name -> case. Every one must be bit-identical to llama.cpp (see tests/test_lm.py)
CASES = {
    "qwen3moe_f32": Case(_s(arch="qwen3moe", weight_type="f32", seed=1)),
    "qwen3moe_q8_0": Case(_s(arch="qwen3moe", weight_type="q8_0", seed=2)),
    "qwen3moe_f16_tied": Case(_s(arch="qwen3moe", weight_type="f16", tie_embeddings=True, seed=3)),
    "qwen3moe_q8_0_ubatch5": Case(_s(arch="qwen3moe", weight_type="q8_0", seed=8), 5),
    # the types llama.cpp repacks on AVX2 (Q4_0 -> q4_0_8x8, Q4_K -> q4_K_8x8, IQ4_NL -> iq4_nl_8x8): exact only
    # because ggml-hybrid repacks the same weights (the repacked kernels round differently from the plain ones
    # for products of few rows, which random weights amplify to ~1.5%); ubatches of 5 mix the repacked gemm
    # (4 rows) and gemv (the rest)
    "qwen3moe_q4_K": Case(_s(**_Q4, weight_type="q4_K", seed=4)),
    "qwen3moe_q4_K_ubatch5": Case(_s(**_Q4, weight_type="q4_K", seed=11), 5),
    "qwen3moe_q4_0": Case(_s(**_Q4, weight_type="q4_0", seed=12)),
    "qwen3moe_q4_0_ubatch5": Case(_s(**_Q4, weight_type="q4_0", seed=13), 5),
    "qwen3moe_iq4_nl": Case(_s(**_Q4, weight_type="iq4_nl", seed=14)),
    # repacking off on both sides (llama.cpp's -nr, repack=false): GGML's plain Q4_0 kernels, equal too
    "qwen3moe_q4_0_norepack": Case(_s(**_Q4, weight_type="q4_0", seed=15), 5, {"repack": False}),
    "qwen2moe_q8_0": Case(_s(arch="qwen2moe", weight_type="q8_0", head_dim=16, seed=5)),
    "llama_q6_K": Case(_s(arch="llama", weight_type="q6_K", n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2,
                          head_dim=64, seed=6)),
    # llama.cpp's fixes to the first three: the Hadamard rotation of quantized KV caches (head sizes that are
    # multiples of 64), F32 caches cast to F16 for flash attention, the float32 attention scale (head size 96),
    # YaRN, and an expert_weights_scale key these families do not read
    "qwen3moe_kv_q8_0_hd128": Case(_s(arch="qwen3moe", weight_type="q8_0", n_embd=128, n_head=2, n_head_kv=1,
                                      head_dim=128, seed=31), options={"cache_type_k": "q8_0"}),
    "qwen3moe_kv_q8_0_fa_hd64": Case(_s(arch="qwen3moe", weight_type="q8_0", head_dim=64, seed=32), options=_Q8),
    "qwen3moe_kv_f32_fa": Case(_s(arch="qwen3moe", weight_type="f32", seed=33),
                               options={"cache_type_k": "f32", "cache_type_v": "f32", "flash_attn": True}),
    "qwen3moe_yarn_hd96": Case(_s(arch="qwen3moe", n_head=2, n_head_kv=1, head_dim=96, rope_scaling="yarn",
                                  rope_factor=4.0, rope_orig_ctx=256, weights_scale=2.0, seed=10)),
    "llama_spm_q8_0": Case(_s(arch="llama", vocab="spm", vocab_size=512, weight_type="q8_0", seed=35)),
    "olmoe_f32": Case(_s(arch="olmoe", n_head_kv=4, head_dim=16, seed=41)),
    "olmoe_f16": Case(_s(arch="olmoe", n_head_kv=4, head_dim=16, weight_type="f16", weights_scale=3.0, seed=42)),
    "olmoe_q8_0": Case(_s(arch="olmoe", n_head_kv=4, head_dim=16, weight_type="q8_0", seed=43)),
    "glm4moe_f32": Case(_s(**_GLM, nextn=1, qk_norm=True, seed=51)),
    "glm4moe_f16": Case(_s(**_GLM, weight_type="f16", seed=52)),
    "glm4moe_q8_0": Case(_s(**_GLM, weight_type="q8_0", tie_embeddings=True, seed=53)),
    # pinned selection bias + a large router: the picked experts' sigmoid weights sum below 2**-14 (the clamp)
    "glm4moe_clamp": Case(_s(**_GLM, router_scale=40.0, bias_pin=2, seed=54)),
    "deepseek2_v3_f32": Case(_s(**_DS_V3, seed=61)),
    "deepseek2_v2lite_f16": Case(_s(arch="deepseek2", n_layer=3, n_dense_lead=1, q_lora_rank=0, norm_weights=False,
                                    selection_bias=False, rope_scaling="yarn", rope_factor=40.0, rope_orig_ctx=512,
                                    yarn_log_mul=0.0707, weight_type="f16", seed=62)),
    "deepseek2_kimi_q8_0": Case(_s(arch="deepseek2", n_layer=3, n_dense_lead=1, n_expert=12, n_used=3,
                                   gating="sigmoid", weights_scale=2.827, n_group=1, n_group_used=1,
                                   rope_scaling="yarn", rope_factor=32.0, rope_orig_ctx=512, yarn_log_mul=0.1,
                                   rope_freq_base=50000.0, weight_type="q8_0", seed=63)),
    "deepseek2_v3_q8_0_fa_kv_q8_0": Case(_s(**_DS_V3, weight_type="q8_0", seed=64), options=_Q8),
    "gpt_oss_mxfp4": Case(_s(**_OSS, weight_type="q8_0", expert_type="mxfp4", seed=71)),
    "gpt_oss_mxfp4_ubatch7": Case(_s(**_OSS, weight_type="q8_0", expert_type="mxfp4", seed=72), 7),
    "gpt_oss_f32": Case(_s(**_OSS, seed=73)),
    "gpt_oss_f16": Case(_s(**_OSS, weight_type="f16", seed=74)),
    "gpt_oss_q8_0": Case(_s(**_OSS, weight_type="q8_0", seed=75)),
    "gpt_oss_mxfp4_fa_kv_q8_0_hd64": Case(_s(**{**_OSS, "head_dim": 64}, weight_type="q8_0", expert_type="mxfp4",
                                             seed=76), options=_Q8),
    # recurrent models: prompts in one ubatch, in ubatches of 5 and 7, and token-by-token decode after a prompt
    "qwen3next_f32": Case(_s(**_NEXT, seed=81), decode_from=20),
    "qwen3next_q8_0_ubatch5": Case(_s(**_NEXT, weight_type="q8_0", seed=82), 5, decode_from=20),
    # files converted before llama.cpp split ssm_in; per-layer flags; a next-token-prediction block (skipped)
    "qwen3next_ssm_in_q8_0": Case(_s(arch="qwen3next", n_layer=3, n_rot=8, qkvz_fused=True,
                                     recurrent_layers="1,0,1,0", nextn=1, weight_type="q8_0", seed=83)),
    "qwen35moe_f32": Case(_s(**_Q35, seed=91), decode_from=20, texts=_MARKS),
    "qwen35moe_q8_0_ubatch7": Case(_s(**_Q35, weight_type="q8_0", tie_embeddings=True, seed=92), 7,
                                   decode_from=20, texts=_MARKS),
    # sections that leave some rotated pairs to the 4th position axis (0 for text): not NEOX's rope
    "qwen35moe_sections_f16": Case(_s(**{**_Q35, "n_rot": 16}, rope_sections="1,1,1,1", weight_type="f16",
                                      seed=93)),
    # a Q8_0 KV cache (Hadamard-rotated, head size 64) with flash attention
    "qwen35moe_q8_0_fa_kv_q8_0_hd64": Case(_s(**{**_Q35, "head_dim": 64, "n_rot": 16}, weight_type="q8_0",
                                              seed=94), options=_Q8, decode_from=20),
}


# Cases recorded with every layer on llama.cpp's Vulkan0 (llama-cpp-python built with -DGGML_VULKAN=on; here Mesa's
# lavapipe): F32, Q8_0, Q4_0 and Q4_K weights, four families, a recurrent one among them. Tests run them on Vulkan0.
VULKAN_CASES = {name: CASES[name] for name in (
    "qwen3moe_f32", "qwen3moe_q8_0", "qwen3moe_q4_0", "qwen3moe_q4_K_ubatch5", "olmoe_q8_0", "glm4moe_f32",
    "qwen35moe_f32", "qwen35moe_q8_0_ubatch7")}


# the CPU features GGML's native build picks its kernels by: fixtures are exact on a machine with the same set
SIMD_FLAGS = ("sse3", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avxvnni", "amx_tile", "asimd", "sve")


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        return []


def simd_tag() -> str:
    """This CPU's SIMD features among ``SIMD_FLAGS``, space-separated in that order (``GGML_HYBRID_SIMD_TAG``
    overrides it: a tag no fixture has runs the tests on their tolerance path)."""
    forced = os.environ.get("GGML_HYBRID_SIMD_TAG")
    if forced is not None:
        return forced
    flags = _cpu_flags()
    return " ".join(x for x in SIMD_FLAGS if x in flags)


# -- logits recorded on more than one CPU (the format: this module's docstring) ---------------------------------


def simd_dir(fixtures: str, tag: str) -> str:
    """The directory of the variants of the fixtures in ``fixtures`` recorded on a CPU with ``tag``."""
    return os.path.join(fixtures, "simd", "-".join(tag.split()) or "none")


def _is_input_key(key: str) -> bool:
    return key == "tokens" or key.endswith("sha256")


def write_simd_variant(base_path: str, tag: str, arrays: dict[str, np.ndarray]) -> str:
    """Record ``arrays`` (logits keys of the base fixture at ``base_path``) as recorded on a CPU with ``tag``."""
    with np.load(base_path) as z:
        base = {k: z[k] for k in z.files}
    if str(base["simd"]) == tag:
        raise ValueError(f"{base_path} was recorded with simd tag {tag!r} itself: rewrite it, not a variant")
    rec: dict[str, np.ndarray] = {k: v for k, v in base.items() if _is_input_key(k)}
    for k, v in arrays.items():
        ref = base.get(k)
        got = np.ascontiguousarray(v, dtype=np.float32)
        if ref is None or ref.dtype != np.float32 or ref.shape != got.shape:
            raise ValueError(f"{base_path}: key {k!r} is not a float32 array of shape {got.shape} in the base")
        rec[f"xor_{k}"] = got.view(np.uint32) ^ ref.view(np.uint32)
    dst = os.path.join(simd_dir(os.path.dirname(base_path), tag), os.path.basename(base_path))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    np.savez_compressed(dst, simd=np.asarray(tag), **rec)
    return dst


def variant_paths(base_path: str) -> list[str]:
    """The variants recorded for the base fixture at ``base_path`` (one per other tag)."""
    root = os.path.join(os.path.dirname(base_path), "simd")
    name = os.path.basename(base_path)
    tags = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [os.path.join(root, t, name) for t in tags if os.path.exists(os.path.join(root, t, name))]


def load_for_cpu(base_path: str, tag: str | None = None) -> tuple[dict[str, np.ndarray], bool]:
    """The fixture at ``base_path`` with the logits llama.cpp gave on a CPU with ``tag`` (default: this CPU's), and
    whether it has them: ``(arrays, True)``; ``(the base's arrays, False)`` when no recording has that tag (then the
    logits are another CPU's: compare within a tolerance, not bit for bit)."""
    tag = simd_tag() if tag is None else tag
    with np.load(base_path) as z:
        fx = {k: z[k] for k in z.files}
    if str(fx["simd"]) == tag:
        return fx, True
    path = os.path.join(simd_dir(os.path.dirname(base_path), tag), os.path.basename(base_path))
    if not os.path.exists(path):
        return fx, False
    with np.load(path) as v:
        var = {k: v[k] for k in v.files}
    if str(var.get("simd")) != tag:
        raise ValueError(f"{path}: recorded with simd tag {str(var.get('simd'))!r}, not {tag!r}")
    for k, val in fx.items():
        if _is_input_key(k) and not np.array_equal(var.get(k), val):
            raise ValueError(f"{path}: stale, its {k!r} is not the base's; record the variant again")
    for key, bits in var.items():
        if key.startswith("xor_"):
            fx[key[4:]] = (fx[key[4:]].view(np.uint32) ^ bits).view(np.float32)
    fx["simd"] = np.asarray(tag)
    return fx, True


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prompt_tokens(path) -> list[int]:
    from ggml_hybrid.gguf.store import GGUFStore
    from ggml_hybrid.text.tokenizer import Tokenizer

    store = GGUFStore(path)
    try:
        return Tokenizer.from_gguf(store).encode(PROMPT)
    finally:
        store.close()


def reference(llama_python: str, model: str, tokens: list[int], case: Case, out_npy: str, last_npy: str,
              gpu: bool = False) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [llama_python, os.path.join(here, "llama_reference.py"), model, "--tokens", ",".join(map(str, tokens)),
           "--texts-json", json.dumps(TEXTS + list(case.texts)), "--out", out_npy, "--last-out", last_npy,
           "--ubatch", str(case.ubatch),
           "--type-k", case.options.get("cache_type_k", "f16"), "--type-v", case.options.get("cache_type_v", "f16")]
    if case.options.get("flash_attn"):
        cmd.append("--flash-attn")
    if case.decode_from:
        cmd += ["--decode-from", str(case.decode_from), "--decode-out", out_npy[:-4] + ".decode.npy"]
    if case.options.get("repack") is False:  # both sides repack by default; a case that turns it off does so on both
        cmd.append("--no-repack")
    env = None
    if gpu:  # every layer on the library's GPU backend; lavapipe (a CPU Vulkan driver) only when named
        cmd += ["--n-gpu-layers", "-1"]
        env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode:
        raise SystemExit(f"llama_reference failed for {model}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python==0.3.36")
@click.option("--out", default=os.path.join("tests", "fixtures", "llama_ref"), show_default=True)
@click.option("--case", "cases", multiple=True, help="only these cases (repeat)")
@click.option("--vulkan", is_flag=True,
              help="VULKAN_CASES on llama.cpp's Vulkan0 (--llama-python built with CMAKE_ARGS=-DGGML_VULKAN=on), into "
                   "tests/fixtures/llama_ref_vulkan unless --out")
def main(llama_python: str, out: str, cases: tuple[str, ...], vulkan: bool) -> None:
    device = "CPU"
    if vulkan:
        if out == os.path.join("tests", "fixtures", "llama_ref"):
            out = os.path.join("tests", "fixtures", "llama_ref_vulkan")
        os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")  # before the backends load (lavapipe: by name only)
        from ggml_hybrid.ggml.backend import devices

        # the kernels GGML's Vulkan backend picks depend on the device (and driver): tests compare on the same one
        device = next((d.description for d in devices() if d.name == "Vulkan0"), "")
        if not device:
            raise SystemExit("--vulkan: this install has no Vulkan0 (python -m ggml_hybrid_build --vulkan; "
                             "a Vulkan driver)")
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in (VULKAN_CASES if vulkan else CASES).items():
            if cases and name not in cases:
                continue
            path = write_model(os.path.join(tmp, f"{name}.gguf"), case.spec)
            tokens = prompt_tokens(path)
            npy, last = os.path.join(tmp, f"{name}.npy"), os.path.join(tmp, f"{name}.last.npy")
            info = reference(llama_python, path, tokens, case, npy, last, gpu=vulkan)
            decode = {"decode_from": case.decode_from, "decode_logits": np.load(npy[:-4] + ".decode.npy")} \
                if case.decode_from else {}
            rec = dict(spec=json.dumps(asdict(case.spec)), **decode, sha256=sha256(path),
                       tokens=np.asarray(tokens, np.int32), logits=np.load(npy), last_logits=np.load(last),
                       ubatch=case.ubatch, options=json.dumps(case.options), tokenized=json.dumps(info["tokenized"]),
                       llama_cpp_python=info["llama_cpp_python"], simd=simd_tag(), device=device)
            dst = os.path.join(out, f"{name}.npz")
            if _same_inputs_other_cpu(dst, rec):
                logits = {k: rec[k] for k in ("logits", "last_logits", "decode_logits") if k in rec}
                var = write_simd_variant(dst, simd_tag(), logits)
                print(f"{name}: {len(tokens)} positions, variant {var}, {os.path.getsize(var)} bytes")
                continue
            for var in variant_paths(dst):  # recorded against the inputs being replaced
                os.remove(var)
            np.savez_compressed(dst, **rec)
            print(f"{name}: {len(tokens)} positions, {os.path.getsize(dst)} bytes")


def _same_inputs_other_cpu(dst: str, rec: dict) -> bool:
    """Whether ``dst`` exists, was recorded on a CPU with another tag, and describes the same model, prompt and
    texts as ``rec``: then ``rec``'s logits are a variant of it, and it stays as it is."""
    if not os.path.exists(dst):
        return False
    with np.load(dst) as z:
        return str(z["simd"]) != rec["simd"] and all(
            np.array_equal(z[k], rec[k]) for k in ("sha256", "tokens", "tokenized", "options", "ubatch")) \
            and ModelSpec(**json.loads(str(z["spec"]))) == ModelSpec(**json.loads(rec["spec"]))  # fields added later

if __name__ == "__main__":
    main()
