/* The device side of `ggml-hybrid rpc-server`: GGML's RPC server over devices that may report a
   memory size of the user's choosing (--mem), as llama.cpp's rpc-server once did. */
#pragma once

#include <stddef.h>

#include "ggml-backend.h"

/* Devices one server may serve (GGML's RPC protocol numbers them per server). */
#define HY_RPC_SERVER_MAX_DEVICES 16

/* Serve `devices` on `endpoint` (HOST:PORT) with GGML's RPC server, `n_threads` CPU threads, each device
   reporting `mem` bytes free and total when mem > 0; only the ops of hy_rpc_server_ops unless `unchecked_ops`.
   Blocks for as long as the server runs; returns -1 when this build has no RPC backend, GGML's server has no
   rules for one of those ops or the arguments are out of range, 0 when the server stopped (it could not
   listen: GGML said why on stderr). */
int hy_rpc_serve(const char * endpoint, size_t n_threads, ggml_backend_dev_t * devices, size_t n_devices,
                          size_t mem, int unchecked_ops);

/* The ops a server computes without --unchecked-ops (the families' graphs'), `*n` of them. */
const enum ggml_op * hy_rpc_server_ops(size_t * n);

/* Make Ctrl-C (SIGINT) end the waits for RPC servers in progress (GGML's RPC client gives up their
   connections), then run the handler that was installed (Python's). Returns 1 when installed, 0 when it
   already was or SIGINT is ignored, -1 when this build has no RPC client or it failed. Python replacing its
   SIGINT handler later removes it. */
int hy_rpc_watch_interrupts(void);
