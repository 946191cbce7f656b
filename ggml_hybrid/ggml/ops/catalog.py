"""Which method builds each of the pin's operations, and why the rest have none.

The op, unary-kind and GLU-kind lists come from the library itself (``ggml_op_name``, ``ggml_unary_op_name`` and
``ggml_glu_op_name`` over their enums); tests/test_ops_catalog.py checks these tables against them and against the
pin's ggml.h, so an op a new pin adds is a failing test until it has a method or a stated reason.
"""

from __future__ import annotations

from ..._native import cstr, lib

#: every GGML_OP_* of the library: name (without the prefix) -> enum value
OP_CODES: dict[str, int] = {cstr(lib.ggml_op_name(i)): i for i in range(lib.GGML_OP_COUNT)}

#: GGML op -> the OpsMixin methods whose nodes have that op
OP_METHODS: dict[str, tuple[str, ...]] = {
    "DUP": ("dup",),
    "ADD": ("add", "add_cast"),
    "ADD_ID": ("add_id",),
    "ADD1": ("add1",),
    "ACC": ("acc",),
    "SUB": ("sub",),
    "MUL": ("mul",),
    "DIV": ("div",),
    "SQR": ("sqr",),
    "SQRT": ("sqrt",),
    "LOG": ("log",),
    "SIN": ("sin",),
    "COS": ("cos",),
    "SUM": ("sum",),
    "SUM_ROWS": ("sum_rows",),
    "CUMSUM": ("cumsum",),
    "MEAN": ("mean",),
    "ARGMAX": ("argmax",),
    "COUNT_EQUAL": ("count_equal",),
    "REPEAT": ("repeat", "repeat_like"),
    "REPEAT_BACK": ("repeat_back",),
    "CONCAT": ("concat",),
    "SILU_BACK": ("silu_back",),
    "NORM": ("norm",),
    "RMS_NORM": ("rms_norm",),
    "RMS_NORM_BACK": ("rms_norm_back",),
    "GROUP_NORM": ("group_norm",),
    "L2_NORM": ("l2_norm",),
    "MUL_MAT": ("mul_mat", "mul_mat_f32", "mul_mat_hadamard"),
    "MUL_MAT_ID": ("mul_mat_id",),
    "OUT_PROD": ("out_prod",),
    "SCALE": ("scale", "scale_bias"),
    "SET": ("set",),
    "CPY": ("cpy", "cast"),
    "CONT": ("cont",),
    "RESHAPE": ("reshape",),
    "VIEW": ("view",),
    "PERMUTE": ("permute",),
    "TRANSPOSE": ("transpose",),
    "GET_ROWS": ("get_rows",),
    "GET_ROWS_BACK": ("get_rows_back",),
    "SET_ROWS": ("set_rows",),
    "DIAG": ("diag",),
    "DIAG_MASK_INF": ("diag_mask_inf",),
    "DIAG_MASK_ZERO": ("diag_mask_zero",),
    "SOFT_MAX": ("soft_max",),
    "SOFT_MAX_BACK": ("soft_max_back",),
    "ROPE": ("rope", "rope_multi"),
    "ROPE_BACK": ("rope_back",),
    "CLAMP": ("clamp",),
    "CONV_TRANSPOSE_1D": ("conv_transpose_1d",),
    "IM2COL": ("im2col", "conv_1d", "conv_2d"),
    "IM2COL_BACK": ("im2col_back",),
    "IM2COL_3D": ("im2col_3d",),
    "COL2IM_1D": ("col2im_1d",),
    "CONV_2D": ("conv_2d_direct",),
    "CONV_3D": ("conv_3d_direct",),
    "CONV_2D_DW": ("conv_2d_dw_direct",),
    "CONV_TRANSPOSE_2D": ("conv_transpose_2d",),
    "POOL_1D": ("pool_1d",),
    "POOL_2D": ("pool_2d",),
    "POOL_2D_BACK": ("pool_2d_back",),
    "UPSCALE": ("interpolate", "upscale"),
    "PAD": ("pad",),
    "PAD_REFLECT_1D": ("pad_reflect_1d",),
    "ROLL": ("roll",),
    "ARANGE": ("arange",),
    "TIMESTEP_EMBEDDING": ("timestep_embedding",),
    "ARGSORT": ("argsort", "argsort_top_k"),
    "TOP_K": ("top_k",),
    "LEAKY_RELU": ("leaky_relu",),
    "TRI": ("tri",),
    "FILL": ("fill",),
    "FLASH_ATTN_EXT": ("flash_attn",),
    "SSM_CONV": ("ssm_conv",),
    "SSM_SCAN": ("ssm_scan",),
    "WIN_PART": ("win_part",),
    "WIN_UNPART": ("win_unpart",),
    "GET_REL_POS": ("get_rel_pos",),
    "ADD_REL_POS": ("add_rel_pos",),
    "RWKV_WKV6": ("rwkv_wkv6",),
    "GATED_LINEAR_ATTN": ("gated_linear_attn",),
    "RWKV_WKV7": ("rwkv_wkv7",),
    "SOLVE_TRI": ("solve_tri",),
    "GATED_DELTA_NET": ("gated_delta_net",),
    "LIGHTNING_INDEXER": ("lightning_indexer",),
    "DSV4_HC_COMB": ("dsv4_hc_comb",),
    "DSV4_HC_PRE": ("dsv4_hc_pre", "dsv4_hc_pre_gated"),
    "DSV4_HC_POST": ("dsv4_hc_post",),
    "UNARY": ("unary", "xielu"),  # and one method per kind: UNARY_METHODS
    "GLU": ("glu",),  # and one method per kind: GLU_METHODS
    "CROSS_ENTROPY_LOSS": ("cross_entropy_loss",),
    "CROSS_ENTROPY_LOSS_BACK": ("cross_entropy_loss_back",),
    "OPT_STEP_ADAMW": ("opt_step_adamw",),
    "OPT_STEP_SGD": ("opt_step_sgd",),
}

#: GGML ops with no method, and why
NOT_EXPOSED: dict[str, str] = {
    "NONE": "not an operation: the op of a leaf (a tensor made by new_tensor)",
    "FLASH_ATTN_BACK": "its constructor aborts in this pin (ggml_flash_attn_back: 'TODO: adapt to "
                       "ggml_flash_attn_ext() changes')",
    "MAP_CUSTOM1": "a C function pointer run by every CPU thread: a Python callable there would hold the GIL per "
                   "element block; write the op in C",
    "MAP_CUSTOM2": "as MAP_CUSTOM1",
    "MAP_CUSTOM3": "as MAP_CUSTOM1",
    "CUSTOM": "as MAP_CUSTOM1",
}

#: GGML ops that have a method but no CPU kernel in this pin (every op above has one: ggml-cpu.c's
#: ggml_compute_forward handles all of them; tests/test_ops_catalog.py reads that switch to keep this true)
NO_CPU_KERNEL: frozenset[str] = frozenset()

#: unary kind -> its method
UNARY_METHODS: dict[str, str] = {
    "abs": "abs", "sgn": "sgn", "neg": "neg", "step": "step", "tanh": "tanh", "elu": "elu", "relu": "relu",
    "sigmoid": "sigmoid", "gelu": "gelu", "gelu_quick": "gelu_quick", "silu": "silu", "hardswish": "hardswish",
    "hardsigmoid": "hardsigmoid", "exp": "exp", "expm1": "expm1", "softplus": "softplus", "gelu_erf": "gelu_erf",
    "xielu": "xielu", "floor": "floor", "ceil": "ceil", "round": "round", "trunc": "trunc",
}

#: GLU kind -> its method
GLU_METHODS: dict[str, str] = {
    "reglu": "reglu", "geglu": "geglu", "swiglu": "swiglu", "swiglu_oai": "swiglu_oai", "geglu_erf": "geglu_erf",
    "geglu_quick": "geglu_quick", "swiglu_clamp": "swiglu_clamp",
}


def method_ops() -> dict[str, str]:
    """Method -> the GGML op (``UNARY`` / ``GLU`` for the kinds) its node has."""
    out = {m: op for op, methods in OP_METHODS.items() for m in methods}
    out.update({m: "UNARY" for m in UNARY_METHODS.values()})
    out.update({m: "GLU" for m in GLU_METHODS.values()})
    return out
