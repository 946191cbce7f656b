// Trimmed declarations from ggml-cpu.h, plus the CUDA entry points that build.py
// maps to NULL/0 when the CUDA backend is not compiled in.
void ggml_cpu_init(void);
ggml_backend_t ggml_backend_cpu_init(void);
bool ggml_backend_is_cpu(ggml_backend_t backend);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_llamafile(void);

ggml_backend_t ggml_hybrid_cuda_init(int device);
int ggml_hybrid_cuda_device_count(void);
