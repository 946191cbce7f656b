/* The executor's loads: an expert's bytes into its slot of every expert tensor, from the mapping or the host tier,
   by plain copies, double-buffered pinned staging or queued uploads (enum hy_load_mode); the host tier's reads
   started as soon as a call knows its experts (fetch_cpu, fetch_loads, fetch_direct), and its arena seen as this
   layer's expert tensors (frames). */
#include "moe_exec_state.h"

#include "clock.h"

#include <string.h>

int hy_loads_init(hy_moe_exec * ex) {
    const hy_moe_config * cfg = &ex->cfg;
    hy_loads * L = &ex->loads;
    L->mode = HY_LOAD_COPY;
    if (!cfg->staging) {
        return HY_OK;
    }
    ggml_backend_dev_t dev = ggml_backend_get_device(cfg->device);
    ggml_backend_buffer_type_t host = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
    if (host != NULL) {
        size_t size = 0;
        for (int i = 0; i < cfg->n_kinds; i++) {
            size = cfg->nbytes[i] > size ? cfg->nbytes[i] : size;
        }
        for (int i = 0; i < 2; i++) {
            L->stage[i].buf = ggml_backend_buft_alloc_buffer(host, size);
            if (L->stage[i].buf == NULL) {
                return -1;
            }
            L->stage[i].ptr = ggml_backend_buffer_get_base(L->stage[i].buf);
            L->stage[i].event = ggml_backend_event_new(dev);
        }
        L->mode = HY_LOAD_STAGED;
        L->pinned_buft = host;
        L->from_frames = cfg->tier != NULL;
    } else if (dev != NULL) {
        /* the backend copies the data when it queues the upload (GGML's RPC client does), so the mapping can be
           the source and reading the next expert overlaps sending this one */
        struct ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        L->mode = props.caps.async ? HY_LOAD_QUEUED : HY_LOAD_COPY;
    }
    return HY_OK;
}

void hy_loads_free(hy_moe_exec * ex) {
    if (ex->pred.n_pf > 0) { /* a prefetch's uploads may still read the staging buffers */
        ggml_backend_synchronize(ex->cfg.device);
    }
    for (int i = 0; i < 2; i++) {
        hy_stage * st = &ex->loads.stage[i];
        if (st->event != NULL) {
            ggml_backend_event_free(st->event);
        }
        if (st->buf != NULL) {
            ggml_backend_buffer_free(st->buf);
        }
    }
}

static void stage_wait(hy_moe_exec * ex, hy_stage * st) {
    if (!st->pending) {
        return;
    }
    const int64_t t = hy_now_ns();
    if (st->event != NULL) {
        ggml_backend_event_synchronize(st->event);
        st->pending = false;
    } else {
        ggml_backend_synchronize(ex->cfg.device);
        ex->loads.stage[0].pending = ex->loads.stage[1].pending = false;
    }
    ex->counters.staging_wait_ns += hy_now_ns() - t;
}

/* Wait for the uploads in flight: only then are the slots they fill whole. */
void wait_loads(hy_moe_exec * ex) {
    hy_loads * L = &ex->loads;
    stage_wait(ex, &L->stage[0]);
    stage_wait(ex, &L->stage[1]);
    if (L->pending) {
        const int64_t t = hy_now_ns();
        ggml_backend_synchronize(ex->cfg.device);
        L->pending = false;
        ex->counters.staging_wait_ns += hy_now_ns() - t;
    }
}

/* A failed call's uploads, waited for: the next call may plan the slots they fill. */
void hy_loads_abandon(hy_moe_exec * ex) {
    hy_loads * L = &ex->loads;
    if (L->pending) {
        ggml_backend_synchronize(ex->cfg.device);
        L->pending = false;
    }
    stage_wait(ex, &L->stage[0]);
    stage_wait(ex, &L->stage[1]);
}

bool hy_mapping_unchanged(const hy_moe_exec * ex) {
    return ex->cfg.fd < 0 || hy_file_unchanged(ex->cfg.fd, ex->cfg.file_id);
}

/* where expert `e`'s bytes of each kind are: the mapping, or the host tier (which reads them first if they are
   not there yet); false with the error set when the tier's read failed */
static bool expert_source(hy_moe_exec * ex, int e, const uint8_t ** src) {
    if (ex->cfg.tier == NULL) {
        for (int i = 0; i < ex->cfg.n_kinds; i++) {
            src[i] = ex->cfg.src[i] + (size_t) e * ex->cfg.nbytes[i];
        }
        return true;
    }
    if (hy_tier_get(ex->cfg.tier, ex->cfg.tier_layer, e, src, NULL) != 0) {
        hy_exec_fail_tier(ex);
        return false;
    }
    return true;
}

/* Copy expert `e` from the mapping (or the host tier) into `slot` of every expert tensor; -1 on failure. A call's
   own load from a tier whose frames are the device's pinned host memory uploads straight from the frame (no
   staging copy): the frame stays the call's until its release, after the call's uploads are waited for. A prefetch
   load (`ahead`) stages as before: its upload may outlive the call that pinned its frame. */
int64_t load(hy_moe_exec * ex, int e, int slot, bool ahead) {
    const uint8_t * srcs[HY_MAX_KINDS];
    if (!expert_source(ex, e, srcs)) {
        return -1;
    }
    hy_loads * L = &ex->loads;
    /* the tier's arena is the pinned type unless that allocation failed (then it is the CPU's) */
    const bool from_frame = L->from_frames && !ahead && hy_tier_buffer_type(ex->cfg.tier) == L->pinned_buft;
    int64_t n = 0;
    for (int i = 0; i < ex->cfg.n_kinds; i++) {
        const size_t nb = ex->cfg.nbytes[i];
        const uint8_t * src = srcs[i];
        if (L->mode == HY_LOAD_QUEUED || (L->mode == HY_LOAD_STAGED && from_frame)) {
            ggml_backend_tensor_set_async(ex->cfg.device, ex->cfg.slot_tensor[i], src, (size_t) slot * nb, nb);
            L->pending = true;
        } else if (L->mode == HY_LOAD_COPY) {
            ggml_backend_tensor_set(ex->cfg.slot_tensor[i], src, (size_t) slot * nb, nb);
        } else {
            /* read expert N+1 from the mapping while expert N uploads from the other pinned buffer */
            hy_stage * st = &L->stage[L->stage_i];
            stage_wait(ex, st);
            memcpy(st->ptr, src, nb);
            ggml_backend_tensor_set_async(ex->cfg.device, ex->cfg.slot_tensor[i], st->ptr, (size_t) slot * nb, nb);
            if (st->event != NULL) {
                ggml_backend_event_record(st->event, ex->cfg.device);
            }
            st->pending = true;
            L->stage_i ^= 1;
            ex->counters.bytes_staged += (int64_t) nb;
        }
        n += (int64_t) nb;
    }
    return n;
}

/* ---- the host tier ----------------------------------------------------------------------------- */

/* The tier's arena as this layer's expert tensors, made once (host_tier.h: hy_tier_view): the CPU's mul_mat_id
   reads expert i at data + i * nb[2], so a frame index is an expert index and the CPU computes straight from the
   tier. */
int tier_views(hy_moe_exec * ex) {
    if (ex->frames.ctx != NULL) {
        return HY_OK;
    }
    struct ggml_init_params params = { ggml_tensor_overhead() * HY_MAX_KINDS, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    if (ctx == NULL) {
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory%s", "");
    }
    const hy_experts * s = &ex->cfg.slots;
    hy_experts w = { 0 };
    for (int k = 0; k < ex->cfg.n_kinds; k++) {
        const struct ggml_tensor * like = ex->cfg.slot_tensor[k];
        struct ggml_tensor * t = hy_tier_view(ex->cfg.tier, ctx, ex->cfg.tier_layer, k, like);
        if (t == NULL) {
            ggml_free(ctx);
            return hy_exec_fail_tier(ex);
        }
        ggml_format_name(t, "tier.%d.%d", ex->cfg.layer, k);
        struct ggml_tensor ** field = hy_experts_field(&w, s, like);
        if (field == NULL) {
            ggml_free(ctx);
            return hy_exec_fail(ex, HY_ERR_INPUT, "layer %d: an expert tensor that is no slot tensor%s", "");
        }
        *field = t;
        ex->frames.n = (int) t->ne[ggml_n_dims(like) - 1];
    }
    ex->frames.w = w;
    ex->frames.ctx = ctx;
    return HY_OK;
}

/* experts[0..n)'s frames in the tier, each read waited for, in per.slot_of: the expert indices the tier's tensors
   give them (-1, the error set, when a read failed) */
int tier_frames(hy_moe_exec * ex, const int32_t * experts, int n) {
    if (tier_views(ex) != HY_OK) {
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (hy_tier_get(ex->cfg.tier, ex->cfg.tier_layer, experts[i], NULL, &ex->per.slot_of[experts[i]]) != 0) {
            return hy_exec_fail_tier(ex);
        }
    }
    return HY_OK;
}

/* The host tier starts reading the CPU's experts first, before the device's loads, so that the worker, which waits
   for them (submit_cpu), starts as early as it can. */
int fetch_cpu(hy_moe_exec * ex, hy_call * call) {
    if (call->n_cpu > 0 && hy_tier_fetch(ex->cfg.tier, ex->cfg.tier_layer, ex->per.last_cpu, call->n_cpu) != 0) {
        return hy_exec_fail_tier(ex);
    }
    return HY_OK;
}

/* The host tier starts reading every round's misses as soon as the plan names them, several in flight; each load
   waits for its own. */
int fetch_loads(hy_moe_exec * ex, hy_call * call) {
    const hy_plan * p = call->plan;
    if (p->n_loads > 0 && hy_tier_fetch(ex->cfg.tier, ex->cfg.tier_layer, p->load_expert, p->n_loads) != 0) {
        return hy_exec_fail_tier(ex);
    }
    return HY_OK;
}

/* Tier-direct: every expert of the call read (or found) in the tier, the reads started now; call->d0 marks the start
   of the wait that compute_direct counts as loading. */
int fetch_direct(hy_moe_exec * ex, hy_call * call) {
    if (tier_views(ex) != HY_OK) {
        return -1;
    }
    call->d0 = hy_now_ns();
    if (hy_tier_fetch(ex->cfg.tier, ex->cfg.tier_layer, ex->per.experts, call->n_experts) != 0) {
        return hy_exec_fail_tier(ex);
    }
    return HY_OK;
}
