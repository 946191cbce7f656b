// GGML's RPC backend (ggml-rpc.h), reached as llama.cpp reaches it: its functions are proc addresses of the
// "RPC" entry of GGML's registry (ggml_backend_rpc_add_server, _start_server and, with patch 0003,
// _get_error), whether the backend is linked into the module or loaded at run time; ggml/rpc.py casts them.
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
