// Trimmed declarations from ggml-cpu.h.
void ggml_cpu_init(void);
ggml_backend_t ggml_backend_cpu_init(void);
bool ggml_backend_is_cpu(ggml_backend_t backend);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_llamafile(void);


// A persistent threadpool per CPU backend: without one, every graph compute
// (every split) starts and joins its own threads.
struct ggml_threadpool_params {
    int n_threads;
    uint32_t poll;
    bool paused;
    ...;
};
typedef struct ggml_threadpool * ggml_threadpool_t;
void ggml_threadpool_params_init(struct ggml_threadpool_params * p, int n_threads);
struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
void ggml_threadpool_free(struct ggml_threadpool * threadpool);
void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, ggml_threadpool_t threadpool);
