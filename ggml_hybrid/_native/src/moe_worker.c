#include "moe_worker.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "cpu_backend.h"
#include "ggml-cpu.h"
#include "moe_exec.h"

/* The graph row count for n rows (hy_row_bucket) and the expert padding rows use: one absent from the job,
   so that no computed expert gets rows it would not have in the resident graph; exact when every expert is
   present (ggml_hybrid/moe/row_graphs.py: bucket_rows). */
static int bucket_rows(hy_worker * w, const hy_job * job, int * pad_id) {
    const int n = job->n;
    const int bucket = hy_row_bucket(n);
    *pad_id = 0;
    if (bucket == n) {
        return n;
    }
    memset(w->used, 0, job->n_expert);
    for (int i = 0; i < n; i++) {
        w->used[job->ids[i]] = 1;
    }
    for (int e = 0; e < job->n_expert; e++) {
        if (!w->used[e]) {
            *pad_id = e;
            return bucket;
        }
    }
    return n;
}

/* Whether every row of the job is the same token's (a decode step's CPU share): bitwise equal inputs. */
static bool one_token(const hy_job * job) {
    const size_t row = sizeof(float) * (size_t) job->n_embd;
    for (int i = 1; i < job->n; i++) {
        if (memcmp(job->x, job->x + (size_t) i * job->n_embd, row) != 0) {
            return false;
        }
    }
    return true;
}

/* The rows of one token as the resident graph computes them at decode: one input row, its n experts
   (x [E,1,1], ids [n,1]). mul_mat_id then quantizes the row once instead of once per expert; every
   expert still sees that one row, through the same kernel, so the results are the same bits. */
static int run_token(hy_worker * w, hy_job * job) {
    hy_graph * g = hy_graph_get(&w->graphs, HY_GRAPH_TOKEN, job->n, job->w, job->key, 1, job->n_embd, job->glu);
    if (g == NULL) {
        snprintf(w->err, sizeof(w->err), "cannot allocate the CPU worker's graph for %d experts", job->n);
        return HY_ERR_ALLOC;
    }
    const size_t row_bytes = sizeof(float) * (size_t) job->n_embd;
    memcpy(g->x->data, job->x, row_bytes);
    memcpy(g->ids->data, job->ids, sizeof(int32_t) * job->n);
    if (ggml_backend_graph_compute(w->backend, g->gf) != GGML_STATUS_SUCCESS) {
        snprintf(w->err, sizeof(w->err), "the CPU worker's expert graph failed");
        return HY_ERR_COMPUTE;
    }
    memcpy(job->out, g->out->data, row_bytes * job->n);
    return HY_OK;
}

static int run_job(hy_worker * w, hy_job * job) {
    if (w->fail_next) {
        w->fail_next = 0;
        snprintf(w->err, sizeof(w->err), "injected CPU worker failure");
        return HY_ERR_INJECTED;
    }
    if (job->n_expert > w->cap_expert) {
        uint8_t * used = realloc(w->used, job->n_expert);
        if (used == NULL) {
            snprintf(w->err, sizeof(w->err), "out of host memory");
            return HY_ERR_ALLOC;
        }
        w->used = used;
        w->cap_expert = job->n_expert;
    }
    if (job->n <= HY_EXACT_ROWS && one_token(job)) {
        return run_token(w, job);
    }
    int pad = 0;
    const int rows = bucket_rows(w, job, &pad);
    hy_graph * g = hy_graph_get(&w->graphs, HY_GRAPH_ROWS, rows, job->w, job->key, 1, job->n_embd, job->glu);
    if (g == NULL) {
        snprintf(w->err, sizeof(w->err), "cannot allocate the CPU worker's graph for %d rows", rows);
        return HY_ERR_ALLOC;
    }
    /* host buffers: the inputs are written in place */
    const size_t row_bytes = sizeof(float) * (size_t) job->n_embd;
    float * x = (float *) g->x->data;
    int32_t * ids = (int32_t *) g->ids->data;
    memcpy(x, job->x, row_bytes * job->n);
    memset(x + (size_t) job->n * job->n_embd, 0, row_bytes * (rows - job->n));
    memcpy(ids, job->ids, sizeof(int32_t) * job->n);
    for (int i = job->n; i < rows; i++) {
        ids[i] = pad;
    }
    if (ggml_backend_graph_compute(w->backend, g->gf) != GGML_STATUS_SUCCESS) {
        snprintf(w->err, sizeof(w->err), "the CPU worker's expert graph failed");
        return HY_ERR_COMPUTE;
    }
    memcpy(job->out, g->out->data, row_bytes * job->n);
    return HY_OK;
}

static void * worker_main(void * arg) {
    hy_worker * w = arg;
    /* signals are the main thread's (Python handles Ctrl-C there) */
    sigset_t all;
    sigfillset(&all);
    /* but for the faults the thread itself raises, which a blocked mask turns into death: SIGBUS from a
       model file truncated under its reads goes to the mapping's guard (map_guard.h) */
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->has_job && !w->stop) {
            pthread_cond_wait(&w->cv, &w->mu);
        }
        if (w->stop) {
            break;
        }
        hy_job * job = w->job;
        pthread_mutex_unlock(&w->mu);
        job->t_start = hy_now_ns();
        job->status = run_job(w, job);
        job->t_end = hy_now_ns();
        pthread_mutex_lock(&w->mu);
        w->has_job = false;
        w->done = true;
        w->jobs++;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

hy_worker * hy_worker_new(int n_threads) {
    hy_worker * w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return NULL;
    }
    w->n_threads = n_threads;
    /* through GGML's registry (cpu_backend.c): a portable build loads its CPU library at run time */
    w->backend = hy_cpu_init();
    if (w->backend == NULL) {
        free(w);
        return NULL;
    }
    hy_cpu_set_n_threads(w->backend, n_threads);
    struct ggml_threadpool_params tp;
    ggml_threadpool_params_init(&tp, n_threads);
    tp.poll = 0; /* sleep between jobs rather than spin: the device thread shares the cores */
    w->pool = hy_threadpool_new(&tp);
    if (w->pool != NULL) {
        hy_cpu_set_threadpool(w->backend, w->pool);
    }
    w->scratch = hy_scratch_new(ggml_backend_get_default_buffer_type(w->backend));
    if (w->pool == NULL || w->scratch == NULL) {
        hy_worker_free(w);
        return NULL;
    }
    hy_graph_cache_init(&w->graphs, w->scratch);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->done = true;
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        hy_worker_free(w);
        return NULL;
    }
    w->started = true;
    return w;
}

void hy_worker_free(hy_worker * w) {
    if (w == NULL) {
        return;
    }
    if (w->started) {
        pthread_mutex_lock(&w->mu);
        w->stop = true;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL); /* a job in flight finishes first: it reads the mapping */
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
    }
    hy_graph_cache_free(&w->graphs);
    hy_scratch_free(w->scratch);
    if (w->backend != NULL) {
        ggml_backend_free(w->backend);
    }
    if (w->pool != NULL) {
        hy_threadpool_free(w->pool);
    }
    free(w->used);
    free(w);
}

void hy_worker_submit(hy_worker * w, hy_job * job) {
    job->t_submit = hy_now_ns();
    pthread_mutex_lock(&w->mu);
    w->job = job;
    w->has_job = true;
    w->done = false;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int hy_worker_wait(hy_worker * w) {
    pthread_mutex_lock(&w->mu);
    while (!w->done) {
        pthread_cond_wait(&w->cv, &w->mu);
    }
    const int status = w->job != NULL ? w->job->status : HY_OK;
    pthread_mutex_unlock(&w->mu);
    return status;
}

int64_t hy_worker_graph_builds(const hy_worker * w) {
    return w->graphs.builds;
}
