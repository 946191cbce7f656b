// Declared in src/rpc_server.h, defined in src/rpc_server.c: `ggml-hybrid rpc-server`.
#define GGML_HYBRID_RPC_SERVER_MAX_DEVICES ...
int ggml_hybrid_rpc_serve(const char * endpoint, size_t n_threads, ggml_backend_dev_t * devices, size_t n_devices,
        size_t mem);
int ggml_hybrid_rpc_watch_interrupts(void);
