// Declared in src/step_feed.h: a decode step's inputs written in place.
struct hy_feed_row {
    int64_t * k_idx;
    void * mask;
    void * mask_swa;
    int64_t * v_idx;
    int64_t n_kv;
    int64_t at;
};

struct hy_feed {
    int n_rows;
    bool sections;
    bool mask_f16;
    int64_t n_swa;
    int64_t n_embd_v;
    int64_t n_ctx;
    int32_t * tokens;
    int32_t * pos;
    struct hy_feed_row * rows;
};

int hy_feed_write(struct hy_feed * feed, const int32_t * tokens, const int64_t * pos);
