// Python callbacks reached from C (cffi API mode, extern "Python").
extern "Python" bool _hy_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);
