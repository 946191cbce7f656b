/* The CPU worker of a session: one native thread with its own GGML CPU backend and threadpool that
   computes the expert rows of the CPU share from the memory-mapped host experts while the device works.

   One job at a time (a session's layer calls run one after another): the executor hands a job over,
   does its device work, then waits for the job. Graphs are kept per (experts, row bucket) in the
   worker's own graph cache and compute buffer: a steady decode allocates nothing. */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "ggml-backend.h"
#include "moe_graphs.h"

typedef struct hy_job {
    /* in */
    const hy_experts * w;      /* the layer's host experts */
    const void * key;          /* identifies w for the graph cache */
    enum ggml_glu_op glu;
    int n_expert, n_embd;
    int n;                     /* rows */
    const float * x;           /* [n, n_embd] */
    const int32_t * ids;       /* [n]: each row's expert */
    float * out;               /* [n, n_embd] */
    /* out */
    int status;                /* 0, or an HY_ERR_* code */
    int64_t t_submit, t_start, t_end; /* monotonic ns: handed over, compute started, done */
} hy_job;

typedef struct hy_worker {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started, stop, has_job, done;
    hy_job * job;
    int n_threads;
    ggml_backend_t backend;
    struct ggml_threadpool * pool;
    hy_scratch * scratch;
    hy_graph_cache graphs;
    uint8_t * used;            /* [cap_expert]: experts present in a job, to pick a padding row's expert */
    int cap_expert;
    int fail_next;             /* inject a failure into the next job (tests) */
    int64_t jobs;
    char err[256];
} hy_worker;

hy_worker * hy_worker_new(int n_threads);
void hy_worker_free(hy_worker * w);
void hy_worker_submit(hy_worker * w, hy_job * job);
/* waits for the job handed over last; returns its status */
int hy_worker_wait(hy_worker * w);
int64_t hy_worker_graph_builds(const hy_worker * w);
