// From ggml-cpu.h and ggml.h: the threadpool parameters. The CPU backend's own functions are reached through
// GGML's registry (90_build.h: hy_cpu_*), since a portable build loads its CPU library at run time.

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
