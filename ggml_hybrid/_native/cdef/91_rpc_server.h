// Declared in src/rpc_server.h, defined in src/rpc_server.c: `ggml-hybrid rpc-server`.
int hy_rpc_serve(const char * endpoint, size_t n_threads, ggml_backend_dev_t * devices, size_t n_devices,
        size_t mem, int unchecked_ops);
int hy_rpc_watch_interrupts(void);
const enum ggml_op * hy_rpc_server_ops(size_t * n);
