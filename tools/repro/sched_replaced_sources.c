// A graph computed again after ggml_backend_sched split another graph reads freed tensors.
//
// Where a node reads a tensor of another backend, ggml_backend_sched_split_graph makes a copy of it on the
// node's backend, in sched->ctx, and points the node's source at the copy, in the caller's graph. It leaves the
// graph that way. The next split (of any graph) rebuilds sched->ctx, so a graph the caller keeps and computes
// again later (a cached graph: a second prompt of the same length) has sources that point at another graph's
// tensors or at nothing: the split aborts (GGML_ASSERT(src_backend_id != -1)), or the graph reads the wrong data.
//
// This program serves the CPU over GGML's RPC backend in a thread of its own, so that a second backend with
// buffers the CPU cannot read exists on any machine, and computes, with one scheduler over [RPC, CPU]:
//   A: z = 2*x + wa
//   B: z = (3*x) * wb
//   A again
// where the weights wa and wb live in an RPC buffer and the small ops run on the CPU, which reads a copy of the
// weight: the scheduler points z's source at that copy. B's split puts the copy of wb where the copy of wa was, and
// the third compute reads wb in place of wa: on the pin it prints a wrong result (exit status 1). Each compute has
// an input of its own and is checked against the same arithmetic on the host. Exit status 0: all three right.
//
// Build against GGML with its CPU and RPC backends (static):
//   cc sched_replaced_sources.c -I GGML/include -o repro libggml.a libggml-rpc.a libggml-cpu.a libggml-base.a \
//      -lstdc++ -lm -lpthread
// (tools/repro_sched_replaced_sources.py builds it against the pin and against the pin with the fix.)

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"
#include "ggml.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define N 16

static char endpoint[64];

static void * serve(void * dev) {
    ggml_backend_dev_t devices[1] = { (ggml_backend_dev_t) dev };
    ggml_backend_rpc_start_server(endpoint, NULL, 1, 1, devices);
    return NULL;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd < 0 || bind(fd, (struct sockaddr *) &addr, sizeof(addr)) != 0 ||
        getsockname(fd, (struct sockaddr *) &addr, &len) != 0) {
        perror("free_port");
        exit(2);
    }
    close(fd);
    return ntohs(addr.sin_port);
}

// the server listens once a connection to it succeeds (the server drops one that says nothing)
static void wait_for_server(int port) {
    for (int i = 0; i < 1000; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in addr;
        memset(&addr, 0, sizeof(addr));
        addr.sin_family = AF_INET;
        addr.sin_port = htons((uint16_t) port);
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        const int ok = connect(fd, (struct sockaddr *) &addr, sizeof(addr)) == 0;
        close(fd);
        if (ok) {
            return;
        }
        usleep(10000);
    }
    fprintf(stderr, "the RPC server did not start on %s\n", endpoint);
    exit(2);
}

struct graph {
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    struct ggml_tensor * x;  // input, on the CPU
    struct ggml_tensor * y;  // computed on the CPU
    struct ggml_tensor * z;  // computed from y and a weight on RPC
};

static struct graph make_graph(struct ggml_tensor * w, float scale, int add) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true };
    struct graph g;
    g.ctx = ggml_init(params);
    g.x = ggml_new_tensor_1d(g.ctx, GGML_TYPE_F32, N);
    ggml_set_input(g.x);
    g.y = ggml_scale(g.ctx, g.x, scale);
    g.z = add ? ggml_add(g.ctx, g.y, w) : ggml_mul(g.ctx, g.y, w);
    ggml_set_output(g.z);
    g.gf = ggml_new_graph(g.ctx);
    ggml_build_forward_expand(g.gf, g.z);
    return g;
}

// compute g as a caller that keeps its graphs does: reset, place, allocate, set the input, compute, read
static int run(const char * what, int k, ggml_backend_sched_t sched, ggml_backend_t cpu, struct graph * g,
               const float * w, float scale, int add) {
    float x[N], z[N];
    for (int i = 0; i < N; i++) {
        x[i] = (float) (1000 * k + i + 1);  // the k-th compute's own input: stale data cannot pass for it
    }
    ggml_backend_sched_reset(sched);
    ggml_backend_sched_set_tensor_backend(sched, g->y, cpu);
    if (!ggml_backend_sched_alloc_graph(sched, g->gf)) {
        printf("%s: allocation failed\n", what);
        return 1;
    }
    ggml_backend_tensor_set(g->x, x, 0, sizeof(x));
    if (ggml_backend_sched_graph_compute(sched, g->gf) != GGML_STATUS_SUCCESS) {
        printf("%s: compute failed\n", what);
        return 1;
    }
    ggml_backend_tensor_get(g->z, z, 0, sizeof(z));
    for (int i = 0; i < N; i++) {
        const float want = add ? scale * x[i] + w[i] : (scale * x[i]) * w[i];
        if (z[i] != want) {
            printf("%s: z[%d] = %g, expected %g\n", what, i, (double) z[i], (double) want);
            return 1;
        }
    }
    printf("%s: right\n", what);
    return 0;
}

int main(void) {
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    const int port = free_port();
    snprintf(endpoint, sizeof(endpoint), "127.0.0.1:%d", port);
    pthread_t server;
    pthread_create(&server, NULL, serve, cpu_dev);
    wait_for_server(port);

    ggml_backend_t cpu = ggml_backend_dev_init(cpu_dev, NULL);
    ggml_backend_t rpc = ggml_backend_rpc_init(endpoint, 0);
    if (cpu == NULL || rpc == NULL) {
        fprintf(stderr, "no CPU or RPC backend\n");
        return 2;
    }

    // the weights, in a buffer of the RPC backend
    struct ggml_init_params params = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx_w = ggml_init(params);
    struct ggml_tensor * wa = ggml_new_tensor_1d(ctx_w, GGML_TYPE_F32, N);
    struct ggml_tensor * wb = ggml_new_tensor_1d(ctx_w, GGML_TYPE_F32, N);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors(ctx_w, rpc);
    float wav[N], wbv[N];
    for (int i = 0; i < N; i++) {
        wav[i] = (float) (100 + i);
        wbv[i] = (float) (500 + i);
    }
    ggml_backend_tensor_set(wa, wav, 0, sizeof(wav));
    ggml_backend_tensor_set(wb, wbv, 0, sizeof(wbv));

    ggml_backend_t backends[2] = { rpc, cpu };
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends, NULL, 2, 64, false, true);
    struct graph a = make_graph(wa, 2.0f, 1);
    struct graph b = make_graph(wb, 3.0f, 0);

    int failed = run("graph A", 0, sched, cpu, &a, wav, 2.0f, 1);
    failed |= run("graph B", 1, sched, cpu, &b, wbv, 3.0f, 0);
    failed |= run("graph A again, after B", 2, sched, cpu, &a, wav, 2.0f, 1);

    ggml_backend_sched_free(sched);
    ggml_free(a.ctx);
    ggml_free(b.ctx);
    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
    ggml_backend_free(rpc);
    ggml_backend_free(cpu);
    fflush(stdout);
    _exit(failed);  // the server thread serves for ever: no clean-up of the process's other state
}
