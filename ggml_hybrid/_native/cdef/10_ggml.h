// Trimmed declarations from ggml.h. Enum values and struct layouts are left to
// the compiler ("...") so they can never drift from the pinned headers.
#define GGML_MAX_DIMS ...
#define GGML_MAX_SRC ...
#define GGML_MAX_NAME ...
#define GGML_MAX_OP_PARAMS ...
#define GGML_DEFAULT_GRAPH_SIZE ...
#define GGML_ROPE_TYPE_NORMAL ...
#define GGML_ROPE_TYPE_NEOX ...
#define GGML_ROPE_TYPE_MROPE ...
#define GGML_ROPE_TYPE_IMROPE ...
#define GGML_MROPE_SECTIONS ...

enum ggml_status {
    GGML_STATUS_ALLOC_FAILED,
    GGML_STATUS_FAILED,
    GGML_STATUS_SUCCESS,
    GGML_STATUS_ABORTED,
    ...
};

enum ggml_type {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q8_1, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,
    GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_K, GGML_TYPE_IQ2_XXS,
    GGML_TYPE_IQ2_XS, GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ1_S, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ3_S,
    GGML_TYPE_IQ2_S, GGML_TYPE_IQ4_XS, GGML_TYPE_I8, GGML_TYPE_I16, GGML_TYPE_I32,
    GGML_TYPE_I64, GGML_TYPE_F64, GGML_TYPE_IQ1_M, GGML_TYPE_BF16, GGML_TYPE_TQ1_0,
    GGML_TYPE_TQ2_0, GGML_TYPE_MXFP4, GGML_TYPE_COUNT,
    ...
};

enum ggml_op { GGML_OP_NONE, GGML_OP_VIEW, GGML_OP_TRANSPOSE, GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID, GGML_OP_SOFT_MAX,
    GGML_OP_ARGSORT, GGML_OP_TOP_K, GGML_OP_FLASH_ATTN_EXT, GGML_OP_COUNT, ... };

enum ggml_sort_order { GGML_SORT_ORDER_ASC, GGML_SORT_ORDER_DESC, ... };

enum ggml_glu_op {
    GGML_GLU_OP_REGLU, GGML_GLU_OP_GEGLU, GGML_GLU_OP_SWIGLU, GGML_GLU_OP_SWIGLU_OAI,
    GGML_GLU_OP_GEGLU_ERF, GGML_GLU_OP_GEGLU_QUICK, GGML_GLU_OP_SWIGLU_CLAMP, GGML_GLU_OP_COUNT, ...
};

enum ggml_prec { GGML_PREC_DEFAULT, GGML_PREC_F32, ... };

enum ggml_op_hint { GGML_HINT_NONE, GGML_HINT_SRC0_IS_HADAMARD, ... };  // GGML_HINT_ROWWISE: patched/92_rowwise.h

enum ggml_tensor_flag {
    GGML_TENSOR_FLAG_INPUT, GGML_TENSOR_FLAG_OUTPUT, GGML_TENSOR_FLAG_PARAM,
    GGML_TENSOR_FLAG_LOSS, ...
};

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
    GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ...
};

struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    enum ggml_op op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[64];
    ...;
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
void ggml_log_set(ggml_log_callback log_callback, void * user_data);

const char * ggml_status_to_string(enum ggml_status status);

struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
size_t ggml_used_mem(const struct ggml_context * ctx);
void * ggml_get_mem_buffer(const struct ggml_context * ctx);
size_t ggml_get_mem_size(const struct ggml_context * ctx);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);

int64_t ggml_blck_size(enum ggml_type type);
size_t ggml_type_size(enum ggml_type type);
size_t ggml_row_size(enum ggml_type type, int64_t ne);
const char * ggml_type_name(enum ggml_type type);
const char * ggml_op_name(enum ggml_op op);
const char * ggml_op_desc(const struct ggml_tensor * t);
bool ggml_is_quantized(enum ggml_type type);
int64_t ggml_nelements(const struct ggml_tensor * tensor);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
bool ggml_is_contiguous(const struct ggml_tensor * tensor);
bool ggml_is_contiguous_rows(const struct ggml_tensor * tensor);
bool ggml_is_contiguous_1(const struct ggml_tensor * tensor);
bool ggml_is_transposed(const struct ggml_tensor * tensor);
bool ggml_can_repeat(const struct ggml_tensor * t0, const struct ggml_tensor * t1);
bool ggml_validate_row_data(enum ggml_type type, const void * data, size_t nbytes);

struct ggml_tensor * ggml_new_tensor(struct ggml_context * ctx, enum ggml_type type, int n_dims, const int64_t * ne);
struct ggml_tensor * ggml_get_first_tensor(const struct ggml_context * ctx);
struct ggml_tensor * ggml_get_next_tensor(const struct ggml_context * ctx, struct ggml_tensor * tensor);
struct ggml_tensor * ggml_get_tensor(struct ggml_context * ctx, const char * name);
struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);

// ops
struct ggml_tensor * ggml_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
bool ggml_prec_set_acc(struct ggml_tensor * a, enum ggml_prec prec);
void ggml_mul_mat_set_prec(struct ggml_tensor * a, enum ggml_prec prec);
void ggml_mul_mat_set_hint(struct ggml_tensor * a, enum ggml_op_hint hint);
struct ggml_tensor * ggml_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * as, struct ggml_tensor * b, struct ggml_tensor * ids);
struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_add_id(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
        struct ggml_tensor * ids);
struct ggml_tensor * ggml_mul(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_sub(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_neg(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_div(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
struct ggml_tensor * ggml_clamp(struct ggml_context * ctx, struct ggml_tensor * a, float min, float max);
struct ggml_tensor * ggml_fill(struct ggml_context * ctx, struct ggml_tensor * a, float c);
struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_rope_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
        struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base, float freq_scale,
        float ext_factor, float attn_factor, float beta_fast, float beta_slow);
struct ggml_tensor * ggml_rope_multi(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
        struct ggml_tensor * c, int n_dims, int sections[4], int mode, int n_ctx_orig, float freq_base,
        float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow);
struct ggml_tensor * ggml_soft_max_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask,
        float scale, float max_bias);
void ggml_soft_max_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
        struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias, float logit_softcap);
void ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
struct ggml_tensor * ggml_argsort(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_sort_order order);
struct ggml_tensor * ggml_top_k(struct ggml_context * ctx, struct ggml_tensor * a, int k);
struct ggml_tensor * ggml_sum_rows(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_silu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_gelu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_sigmoid(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_softplus(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_glu(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_glu_op op, bool swapped);
struct ggml_tensor * ggml_glu_split(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, enum ggml_glu_op op);
struct ggml_tensor * ggml_swiglu_oai(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
        float alpha, float limit);
struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
        size_t nb1, size_t offset);
struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
        int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
struct ggml_tensor * ggml_reshape_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
        int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1,
        int axis2, int axis3);
struct ggml_tensor * ggml_transpose(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_cont(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_cpy(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_cast(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_type type);
struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, struct ggml_tensor * c);
struct ggml_tensor * ggml_concat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int dim);
struct ggml_tensor * ggml_repeat_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
        int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_ssm_conv(struct ggml_context * ctx, struct ggml_tensor * sx, struct ggml_tensor * c);
struct ggml_tensor * ggml_gated_delta_net(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
        struct ggml_tensor * v, struct ggml_tensor * g, struct ggml_tensor * beta, struct ggml_tensor * state,
        int64_t K);

// graphs
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);

// quantization
bool ggml_quantize_requires_imatrix(enum ggml_type type);
size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows,
        int64_t n_per_row, const float * imatrix);
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
struct ggml_type_traits {
    const char * type_name;
    int64_t blck_size;
    size_t type_size;
    bool is_quantized;
    ggml_to_float_t to_float;
    ggml_from_float_t from_float_ref;
    ...;
};
const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type);
