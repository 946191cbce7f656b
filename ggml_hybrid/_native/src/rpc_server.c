#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "rpc_server.h"

#include <signal.h>
#include <stdio.h>

#include "ggml-backend-impl.h"

/* Copies of the served devices (same functions, except the memory they report) and their originals. */
static struct ggml_backend_device served[HY_RPC_SERVER_MAX_DEVICES];
static ggml_backend_dev_t served_base[HY_RPC_SERVER_MAX_DEVICES];
static size_t served_mem;

static ggml_backend_dev_t base_of(ggml_backend_dev_t dev) {
    return served_base[dev - served];
}

static void served_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    (void) dev;
    *free = served_mem;
    *total = served_mem;
}

static void served_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    ggml_backend_dev_t base = base_of(dev);
    base->iface.get_props(base, props);
    props->memory_free = served_mem;
    props->memory_total = served_mem;
}

/* The server asks a backend's device for its memory: the backend must point at the copy. */
static ggml_backend_t served_init(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_dev_t base = base_of(dev);
    ggml_backend_t backend = base->iface.init_backend(base, params);
    if (backend != NULL) {
        backend->device = dev;
    }
    return backend;
}

/* The ops of the language models' graphs: every family ggml-hybrid runs (model/families/), with and without flash
   attention. Without --unchecked-ops the server computes only these (and the ops that compute nothing, such as
   VIEW), each checked by the shape rules GGML's RPC server has for it (vendor patches 0011 and 0012);
   tests/test_rpc.py runs every family over RPC, and tests/test_rpc_server_ops.py checks each op has its rules. */
static const enum ggml_op family_ops[] = {
    GGML_OP_ADD, GGML_OP_SUB, GGML_OP_MUL, GGML_OP_DIV, GGML_OP_SCALE, GGML_OP_SQR, GGML_OP_SQRT, GGML_OP_UNARY,
    GGML_OP_GLU, GGML_OP_RMS_NORM, GGML_OP_NORM, GGML_OP_MUL_MAT, GGML_OP_CPY, GGML_OP_DUP, GGML_OP_CONT,
    GGML_OP_GET_ROWS, GGML_OP_SET_ROWS, GGML_OP_ROPE, GGML_OP_SOFT_MAX, GGML_OP_ARGSORT, GGML_OP_SUM_ROWS,
    GGML_OP_CLAMP, GGML_OP_FILL, GGML_OP_REPEAT, GGML_OP_CONCAT, GGML_OP_ADD_ID, GGML_OP_MUL_MAT_ID,
    GGML_OP_SSM_CONV, GGML_OP_GATED_DELTA_NET, GGML_OP_FLASH_ATTN_EXT,
};

const enum ggml_op * hy_rpc_server_ops(size_t * n) {
    *n = sizeof(family_ops) / sizeof(family_ops[0]);
    return family_ops;
}

typedef bool (*set_ops_t)(const enum ggml_op * ops, size_t n_ops);
typedef void (*start_server_t)(const char * endpoint, const char * cache_dir, size_t n_threads, size_t n_devices,
                               ggml_backend_dev_t * devices);

int hy_rpc_serve(const char * endpoint, size_t n_threads, ggml_backend_dev_t * devices, size_t n_devices,
                          size_t mem, int unchecked_ops) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    start_server_t start = reg != NULL ? (start_server_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_start_server")
                                       : NULL;
    if (start == NULL || n_devices == 0 || n_devices > HY_RPC_SERVER_MAX_DEVICES) {
        return -1;
    }
    ggml_backend_dev_t use[HY_RPC_SERVER_MAX_DEVICES];
    for (size_t i = 0; i < n_devices; i++) {
        use[i] = devices[i];
        if (mem > 0) {
            served[i] = *devices[i];
            served_base[i] = devices[i];
            served[i].iface.get_memory = served_memory;
            served[i].iface.get_props = served_props;
            served[i].iface.init_backend = served_init;
            use[i] = &served[i];
        }
    }
    served_mem = mem;
    set_ops_t set_ops = (set_ops_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_server_set_ops");
    size_t n_ops;
    const enum ggml_op * ops = hy_rpc_server_ops(&n_ops);
    if (set_ops == NULL || !(unchecked_ops ? set_ops(NULL, 0) : set_ops(ops, n_ops))) {
        return -1;
    }
    /* GGML's server reports on stdout; a line at a time, so that a log or a pipe sees it as it happens */
    setvbuf(stdout, NULL, _IOLBF, 0);
    start(endpoint, NULL, n_threads, n_devices, use);
    return 0;
}

/* ---- the client side: Ctrl-C ends a wait for a server ---------------------------------------------------
   Python runs its SIGINT handler only in the main thread between bytecodes, never while that thread waits
   inside GGML for a server's reply: a frozen server would make Ctrl-C do nothing. This handler goes before
   the one installed (Python's): it tells GGML's RPC client to give up the waits in progress, then calls it. */

typedef void (*rpc_interrupt_t)(void);

static struct sigaction sigint_before;
static rpc_interrupt_t rpc_interrupt;

static void on_sigint(int sig, siginfo_t * info, void * uctx) {
    if (rpc_interrupt != NULL) {
        rpc_interrupt();
    }
    if ((sigint_before.sa_flags & SA_SIGINFO) && sigint_before.sa_sigaction != NULL) {
        sigint_before.sa_sigaction(sig, info, uctx);
    } else if (sigint_before.sa_handler != SIG_DFL && sigint_before.sa_handler != SIG_IGN) {
        sigint_before.sa_handler(sig);
    } else if (sigint_before.sa_handler == SIG_DFL) {
        signal(SIGINT, SIG_DFL);
        raise(SIGINT);
    }
}

int hy_rpc_watch_interrupts(void) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    rpc_interrupt_t fn = reg != NULL ? (rpc_interrupt_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_interrupt")
                                     : NULL;
    if (fn == NULL) {
        return -1;
    }
    struct sigaction now;
    if (sigaction(SIGINT, NULL, &now) != 0) {
        return -1;
    }
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigint) {
        return 0;  /* already in place */
    }
    if (!(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN) {
        return 0;  /* Ctrl-C is ignored: nothing to end */
    }
    rpc_interrupt = fn;
    sigint_before = now;
    struct sigaction act = now;
    act.sa_sigaction = on_sigint;
    act.sa_flags = now.sa_flags | SA_SIGINFO;
    return sigaction(SIGINT, &act, NULL) == 0 ? 1 : -1;
}
