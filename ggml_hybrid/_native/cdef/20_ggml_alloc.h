// Trimmed declarations from ggml-alloc.h.
struct ggml_backend_buffer * ggml_backend_alloc_ctx_tensors(struct ggml_context * ctx, struct ggml_backend * backend);
size_t ggml_backend_alloc_ctx_tensors_from_buft_size(struct ggml_context * ctx, struct ggml_backend_buffer_type * buft);
