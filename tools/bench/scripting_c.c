/* GGML's own C for tools/bench/bench_scripting.py: the baseline the Python graph API and trainer are timed against.

   build N R        build a graph of N nodes (the chain bench_scripting.py builds), R times: one line per build,
                    its seconds
   train FILE E T   train tools/digits.py's network with ggml-opt for E epochs on T CPU threads from FILE (the
                    parameters, then the training and held-out rows, float32, as bench_scripting.py writes them):
                    one line per epoch, "seconds train_loss train_accuracy held_out_loss held_out_accuracy"

   Compiled by bench_scripting.py against the package's GGML headers and libraries (the ones ggml_hybrid loads). */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-opt.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* the chain of bench_scripting.build_chain: x -> (add w, mul w, relu, scale, ...) repeated, n nodes */
static void build(int n_nodes, int reps) {
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        struct ggml_init_params p = {(size_t) (n_nodes + 16) * ggml_tensor_overhead() +
                                     ggml_graph_overhead_custom(n_nodes + 16, false), NULL, true};
        struct ggml_context * ctx = ggml_init(p);
        struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 32);
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 32);
        struct ggml_cgraph * g = ggml_new_graph_custom(ctx, n_nodes + 16, false);
        struct ggml_tensor * cur = x;
        for (int i = 0; i < n_nodes; i++) {
            switch (i % 4) {
                case 0: cur = ggml_add(ctx, cur, w); break;
                case 1: cur = ggml_mul(ctx, cur, w); break;
                case 2: cur = ggml_relu(ctx, cur); break;
                default: cur = ggml_scale(ctx, cur, 0.5f); break;
            }
        }
        ggml_build_forward_expand(g, cur);
        double t1 = now();
        if (ggml_graph_n_nodes(g) != n_nodes) {
            fprintf(stderr, "built %d nodes, not %d\n", ggml_graph_n_nodes(g), n_nodes);
            exit(1);
        }
        ggml_free(ctx);
        printf("%.9f\n", t1 - t0);
    }
}

static float * read_all(const char * path, size_t n) {
    FILE * f = fopen(path, "rb");
    float * buf = malloc(n * sizeof(float));
    if (!f || !buf || fread(buf, sizeof(float), n, f) != n) {
        fprintf(stderr, "cannot read %zu floats from %s\n", n, path);
        exit(1);
    }
    fclose(f);
    return buf;
}

enum { IN = 64, HID = 128, OUT = 10, BATCH = 32, NTRAIN = 1440, NTEST = 352 };

static void train(const char * path, int epochs, int threads) {
    const size_t n_params = HID * IN + HID + OUT * HID + OUT;
    const size_t n = n_params + (size_t) (NTRAIN + NTEST) * (IN + OUT);
    float * all = read_all(path, n);

    ggml_backend_load_all_from_path(getenv("GGML_LIB_DIR"));
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t cpu = ggml_backend_dev_init(dev, NULL);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_set_n_threads_t set_threads =
        (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    set_threads(cpu, threads);

    struct ggml_init_params sp = {8 * ggml_tensor_overhead(), NULL, true};
    struct ggml_context * ctx_static = ggml_init(sp);
    struct ggml_tensor * w1 = ggml_new_tensor_2d(ctx_static, GGML_TYPE_F32, IN, HID);
    struct ggml_tensor * b1 = ggml_new_tensor_1d(ctx_static, GGML_TYPE_F32, HID);
    struct ggml_tensor * w2 = ggml_new_tensor_2d(ctx_static, GGML_TYPE_F32, HID, OUT);
    struct ggml_tensor * b2 = ggml_new_tensor_1d(ctx_static, GGML_TYPE_F32, OUT);
    struct ggml_tensor * images = ggml_new_tensor_2d(ctx_static, GGML_TYPE_F32, IN, BATCH);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx_static, cpu);
    const float * p = all;
    struct ggml_tensor * params[] = {w1, b1, w2, b2};
    for (int i = 0; i < 4; i++) {
        ggml_backend_tensor_set(params[i], p, 0, ggml_nbytes(params[i]));
        p += ggml_nelements(params[i]);
        ggml_set_param(params[i]);
    }
    ggml_opt_dataset_t train_ds = ggml_opt_dataset_init(GGML_TYPE_F32, GGML_TYPE_F32, IN, OUT, NTRAIN, 1);
    ggml_opt_dataset_t test_ds = ggml_opt_dataset_init(GGML_TYPE_F32, GGML_TYPE_F32, IN, OUT, NTEST, 1);
    ggml_backend_tensor_set(ggml_opt_dataset_data(train_ds), p, 0, (size_t) NTRAIN * IN * sizeof(float));
    p += NTRAIN * IN;
    ggml_backend_tensor_set(ggml_opt_dataset_labels(train_ds), p, 0, (size_t) NTRAIN * OUT * sizeof(float));
    p += NTRAIN * OUT;
    ggml_backend_tensor_set(ggml_opt_dataset_data(test_ds), p, 0, (size_t) NTEST * IN * sizeof(float));
    p += NTEST * IN;
    ggml_backend_tensor_set(ggml_opt_dataset_labels(test_ds), p, 0, (size_t) NTEST * OUT * sizeof(float));

    struct ggml_init_params cp = {4096 * ggml_tensor_overhead() + 3 * ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE,
                                                                                               true) + 4096,
                                  NULL, true};
    struct ggml_context * ctx_compute = ggml_init(cp);
    struct ggml_tensor * hidden = ggml_relu(ctx_compute, ggml_add(ctx_compute, ggml_mul_mat(ctx_compute, w1, images), b1));
    struct ggml_tensor * logits = ggml_add(ctx_compute, ggml_mul_mat(ctx_compute, w2, hidden), b2);

    ggml_backend_t backends[] = {cpu};
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends, NULL, 1, 4 * GGML_DEFAULT_GRAPH_SIZE, false, false);
    struct ggml_opt_optimizer_params op = ggml_opt_get_default_optimizer_params(NULL);  /* AdamW, lr 1e-3 */
    struct ggml_opt_params pars = ggml_opt_default_params(sched, GGML_OPT_LOSS_TYPE_CROSS_ENTROPY);
    pars.ctx_compute = ctx_compute;
    pars.inputs = images;
    pars.outputs = logits;
    pars.get_opt_pars = ggml_opt_get_constant_optimizer_params;
    pars.get_opt_pars_ud = &op;
    ggml_opt_context_t opt = ggml_opt_init(pars);
    ggml_opt_result_t res_train = ggml_opt_result_init(), res_test = ggml_opt_result_init();
    for (int e = 0; e < epochs; e++) {
        ggml_opt_result_reset(res_train);
        ggml_opt_result_reset(res_test);
        double t0 = now();
        ggml_opt_epoch(opt, train_ds, res_train, NULL, -1, NULL, NULL);
        double t1 = now();
        ggml_opt_epoch(opt, test_ds, NULL, res_test, 0, NULL, NULL);
        double l_tr, l_te, a_tr, a_te;
        ggml_opt_result_loss(res_train, &l_tr, NULL);
        ggml_opt_result_accuracy(res_train, &a_tr, NULL);
        ggml_opt_result_loss(res_test, &l_te, NULL);
        ggml_opt_result_accuracy(res_test, &a_te, NULL);
        printf("%.9f %.9f %.9f %.9f %.9f\n", t1 - t0, l_tr, a_tr, l_te, a_te);
    }
    ggml_opt_result_free(res_train);
    ggml_opt_result_free(res_test);
    ggml_opt_free(opt);
    ggml_backend_sched_free(sched);
    ggml_free(ctx_compute);
    ggml_opt_dataset_free(train_ds);
    ggml_opt_dataset_free(test_ds);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx_static);
    ggml_backend_free(cpu);
    free(all);
}

int main(int argc, char ** argv) {
    if (argc == 4 && strcmp(argv[1], "build") == 0) {
        build(atoi(argv[2]), atoi(argv[3]));
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "train") == 0) {
        train(argv[2], atoi(argv[3]), atoi(argv[4]));
        return 0;
    }
    fprintf(stderr, "usage: %s build N_NODES REPS | train FILE EPOCHS THREADS\n", argv[0]);
    return 2;
}
