// An index out of range met by a CPU kernel (GET_ROWS, SET_ROWS, MUL_MAT_ID, ADD_ID, ...), added to ggml-cpu.h by
// vendor/patches/0013-cpu-index-faults.patch. The getter is a proc address of the CPU reg
// ("ggml_backend_cpu_get_index_error"; ggml/index_errors.py casts it): a portable build loads the CPU library.
struct ggml_cpu_index_error {
    const struct ggml_tensor * node;
    int32_t node_index;
    int32_t src;
    int64_t value;
    int64_t bound;
};
