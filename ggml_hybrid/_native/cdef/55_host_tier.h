// The host expert tier (src/host_tier.h): whole experts in host RAM, read from the model file by I/O threads.
enum { HY_TIER_FAULT_EIO, HY_TIER_FAULT_SHORT };

typedef struct hy_tier_counters {
    int64_t hits, misses, bytes_read, read_ns, waits, wait_ns, evictions, faults, ahead, ahead_used, ahead_wasted,
        bytes_held;
} hy_tier_counters;

typedef struct hy_tier hy_tier;
hy_tier * hy_tier_new(int fd, const int64_t file_id[4], int64_t budget, int n_threads, int direct, int policy,
        ggml_backend_buffer_type_t buft, char * err, size_t err_size);
void hy_tier_free(hy_tier * t);
int hy_tier_add_layer(hy_tier * t, int label, int n_expert, int n_kinds, const uint64_t * offset,
        const size_t * nbytes);
int hy_tier_fetch(hy_tier * t, int layer, const int32_t * experts, int n);
typedef struct hy_tier_arena_info {
    ggml_backend_buffer_t buffer;
    uint8_t * base;
    size_t frame_bytes;
    int n_frames;
} hy_tier_arena_info;
int hy_tier_arena(hy_tier * t, hy_tier_arena_info * info);
size_t hy_tier_kind_pos(const hy_tier * t, int layer, int kind);
struct ggml_tensor * hy_tier_view(hy_tier * t, struct ggml_context * ctx, int layer, int kind,
        const struct ggml_tensor * like);
ggml_backend_buffer_type_t hy_tier_buffer_type(const hy_tier * t);
int hy_tier_get(hy_tier * t, int layer, int e, const uint8_t ** src, int * frame);
int hy_tier_read_ahead(hy_tier * t, int layer, const int32_t * experts, int n);
int hy_tier_holds(hy_tier * t, int layer, int e);
void hy_tier_settle(hy_tier * t, int layer, const int32_t * experts, int n);
void hy_tier_release(hy_tier * t);
const char * hy_tier_error(const hy_tier * t);
const hy_tier_counters * hy_tier_counters_of(const hy_tier * t);
int hy_tier_direct(const hy_tier * t);
void hy_tier_inject_fault(hy_tier * t, int after, int kind);
