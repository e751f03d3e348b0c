/* CUDA jobs. A part of kvlane.c.
 *
 * A CUDA pool's Write or Load (its gate's set_cuda) is put on the pool's stream whole as it is
 * taken, in arrival order (the stream keeps the registration's order on the GPU): the wait on the
 * engine's ready event, each (layer, part)'s runs by cuMemcpyAsync or the copy kernel's launches
 * (cuda_launch), a load's layer event after each layer, a write's own event at its end. None of
 * these calls waits for the GPU. Its events are then polled between the plane's other work
 * (cuda_poll): a load's layers are published as they land, as a copied one's are, and it ends
 * once its last event has. Its pages stay busy until then.
 * No progress for the gate's cu_wait_ns (--cuda-wait-seconds: an engine's ready event that never
 * fires) gives the pool's GPU work up: the slot is answered DEADLINE_EXCEEDED, the gate says why
 * (cuda_failed: the loop fails the pool, whose release waits for its stream or quarantines it),
 * and the job keeps its pages until the gate closes. A driver error while it is put on the stream
 * records a marker behind what went there; once the marker has, it ends INTERNAL. */

#define CU_SPIN_NS 100000LL /* a CUDA job's events are looked at back to back this long after progress */
#define CU_NAP_MAX_NS 1000000LL

static void cuda_give_up(Engine *e, Job *j, const char *why, int rc) {
    Gate *g = j->gate;
    char reason[sizeof g->cu_failed];
    if (rc)
        snprintf(reason, sizeof reason, "%s (CUresult %d)", why, rc);
    else
        snprintf(reason, sizeof reason, "%s", why);
    pthread_mutex_lock(&g->mu);
    if (!g->cu_failed[0])
        memcpy(g->cu_failed, reason, sizeof reason);
    pthread_mutex_unlock(&g->mu);
    j->cu_stalled = 1;
    if (!j->cu_quiet) {
        char msg[sizeof reason + 128];
        snprintf(msg, sizeof msg, "this client's GPU work is given up on: %s. The client is failed and "
                 "reclaimed; register again", reason);
        answer_slot(e, j, CODE_DEADLINE, msg);
        j->cu_quiet = 1;
    }
    /* The loop learns it from cuda_failed: the reaper's next look at the client (plane_failed)
     * fails and reclaims it, and a loop's copy of the client waiting for its turn fails at once. */
}

/* A kernel job's launches (cuda_takes gave it a span of the gate's argument area): its bases, one a
 * (layer, part) for each side, and its token rows' offsets, written into the span; the widest word
 * dividing the row and every base and offset; then a launch a layer for a load, each followed by
 * the layer's event, or one launch for a write. *enqueued: whether any launch was made. */
static int cuda_launch(Gate *g, Job *j, void *st, int *enqueued) {
    kv_cuda_driver *cu = &g->cu;
    int64_t tb = g->token_bytes, stride = g->dev_stride, nlayers = g->lim.num_layers;
    int64_t nlp = (int64_t)j->nl * g->parts, rows = j->ndev;
    j->cu_args_at = g->cu_args_head;
    j->cu_args_len = j->cu_args_want;
    g->cu_args_head += j->cu_args_len;
    uint64_t *dst_b = (uint64_t *)(g->cu_args + j->cu_args_pos), *src_b = dst_b + nlp;
    int64_t *dst_o = (int64_t *)(src_b + nlp), *src_o = dst_o + rows;
    uint64_t acc = (uint64_t)tb;
    for (uint32_t li = 0; li < j->nl; li++)
        for (int part = 0; part < g->parts; part++) {
            int64_t lp = (int64_t)j->local[li] * g->parts + part, at = (int64_t)li * g->parts + part;
            uint64_t host = (uint64_t)(uintptr_t)(j->host + lp * j->lp_stride) + (uint64_t)g->cu_host_shift;
            uint64_t dev = (uint64_t)(uintptr_t)g->dev_bases[lp];
            dst_b[at] = j->load ? dev : host;
            src_b[at] = j->load ? host : dev;
            acc |= host | dev;
        }
    int64_t row = 0;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = 0; t < j->runs[k].ntok; t++, row++) {
            int64_t h = j->runs[k].host_off + t * tb, d = (j->runs[k].dev_tok + t) * stride;
            dst_o[row] = j->load ? d : h;
            src_o[row] = j->load ? h : d;
            acc |= (uint64_t)h | (uint64_t)d;
        }
    int word = 8, which = 0;
    while (word > 1 && (acc & (uint64_t)(word - 1))) {
        word >>= 1;
        which++;
    }
    void *f = g->cu_kernels[which];
    /* The area is host memory the kernel reads over the bus: written whole before the launch. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    long long n = rows, row_words = tb / word;
    unsigned long long dev_args = (unsigned long long)(uintptr_t)g->cu_args + (unsigned long long)g->cu_args_shift;
    unsigned long long d_dst_o = dev_args + (unsigned long long)((char *)dst_o - g->cu_args);
    unsigned long long d_src_o = dev_args + (unsigned long long)((char *)src_o - g->cu_args);
    int rc = 0;
    for (uint32_t li = 0; !rc && li < (j->load ? j->nl : 1); li++) {
        int count = j->load ? g->parts : (int)nlp;
        int64_t first = j->load ? (int64_t)li * g->parts : 0;
        unsigned long long d_dst_b = dev_args + (unsigned long long)((char *)(dst_b + first) - g->cu_args);
        unsigned long long d_src_b = dev_args + (unsigned long long)((char *)(src_b + first) - g->cu_args);
        int64_t blocks = (rows * count + g->cu_warps - 1) / g->cu_warps;
        if (blocks > g->cu_max_blocks)
            blocks = g->cu_max_blocks;
        void *params[] = {&d_dst_b, &d_src_b, &count, &d_dst_o, &d_src_o, &n, &row_words};
        *enqueued = 1;
        rc = cu->launch_kernel(f, (unsigned)blocks, 1, 1, 32u * (unsigned)g->cu_warps, 1, 1, 0, st, params, NULL);
        if (!rc && j->load)
            rc = cu->event_record(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[li]], st);
    }
    return rc;
}

/* Puts job j on its gate's stream (see above). */
static void cuda_issue(Engine *e, Job *j) {
    Gate *g = j->gate;
    kv_cuda_driver *cu = &g->cu;
    void *st = g->cu_stream;
    int64_t tb = g->token_bytes, stride = g->dev_stride, nlayers = g->lim.num_layers;
    int rc = cu->ctx_set_current(g->cu_ctx);
    if (!rc && !j->load)
        rc = cu->event_create(&j->cu_done, KV_CU_DONE_EVENT_FLAGS);
    int enqueued = 0; /* whether anything of it may be on the stream */
    if (!rc && j->cu_ready) {
        enqueued = 1;
        rc = cu->stream_wait_event(st, j->cu_ready, 0);
    }
    if (!rc && j->cu_kernel)
        rc = cuda_launch(g, j, st, &enqueued);
    for (uint32_t li = 0; !rc && !j->cu_kernel && li < j->nl; li++) {
        for (int part = 0; !rc && part < g->parts; part++) {
            int64_t lp = (int64_t)j->local[li] * g->parts + part;
            uint64_t host = (uint64_t)(uintptr_t)(j->host + lp * j->lp_stride) + (uint64_t)g->cu_host_shift;
            uint64_t dev = (uint64_t)(uintptr_t)g->dev_bases[lp];
            for (int64_t k = 0; !rc && k < j->nruns; k++) {
                const Run *r = &j->runs[k];
                uint64_t h = host + (uint64_t)r->host_off, d = dev + (uint64_t)(r->dev_tok * stride);
                /* A run is one block where the pool's tokens lie back to back; else (the plane
                 * joins no such run for a CUDA job today: make_job) a copy a token, as copy_runs. */
                int64_t pieces = stride == tb ? 1 : r->ntok, bytes = stride == tb ? r->ntok * tb : tb;
                for (int64_t t = 0; !rc && t < pieces; t++) {
                    uint64_t ht = h + (uint64_t)(t * tb), dt = d + (uint64_t)(t * stride);
                    enqueued = 1;
                    rc = j->load ? cu->memcpy_async(dt, ht, (size_t)bytes, st)
                                 : cu->memcpy_async(ht, dt, (size_t)bytes, st);
                }
            }
        }
        if (!rc && j->load)
            rc = cu->event_record(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[li]], st);
    }
    if (!rc && !j->load)
        rc = cu->event_record(j->cu_done, st);
    int64_t t = now_ns();
    j->cu_progress_ns = e->cu_progress_ns = t;
    g->cu_queued += j->cu_ops; /* counted whole, whatever reached the stream, until it ends */
    e->cu_queued += j->cu_ops;
    if (!rc) {
        __atomic_add_fetch(&g->cu_jobs, 1, __ATOMIC_RELAXED);
        if (j->cu_kernel)
            __atomic_add_fetch(&g->cu_kernel_jobs, 1, __ATOMIC_RELAXED);
        if (j->load) { /* the engine may now make its compute stream wait on the layer events */
            j->recorded = 1;
            publish_progress(e, j, 0);
            ring_step(j->lane, j->slot);
        }
        return;
    }
    j->cu_error = rc;
    if (!enqueued) { /* nothing reached the stream: it ends here */
        if (j->cu_done)
            cu->event_destroy(j->cu_done);
        j->cu_done = NULL;
        return; /* cuda_poll ends it */
    }
    /* A marker behind what went on the stream: the pages are let go only once it has passed. */
    if (!j->cu_done && cu->event_create(&j->cu_done, KV_CU_DONE_EVENT_FLAGS) != KV_CU_SUCCESS)
        j->cu_done = NULL;
    if (j->cu_done && cu->event_record(j->cu_done, st) != KV_CU_SUCCESS) {
        cu->event_destroy(j->cu_done);
        j->cu_done = NULL;
    }
    if (!j->cu_done)
        cuda_give_up(e, j, "a copy could not be put on the GPU's stream, nor a marker behind it", rc);
}

/* A job a driver call failed to put on the stream ends INTERNAL, once what reached it has passed. */
static void cuda_end_failed_issue(Engine *e, Job *j) {
    char msg[128];
    snprintf(msg, sizeof msg, "putting the copy on the GPU's stream failed: CUresult %d", j->cu_error);
    finish(e, j, 13 /* INTERNAL */, msg, !j->cu_quiet);
}

/* An issued CUDA job's events, looked at (see above); it may end here. */
static void cuda_poll(Engine *e, Job *j, int64_t t) {
    Gate *g = j->gate;
    kv_cuda_driver *cu = &g->cu;
    if (j->cu_stalled)
        return;
    if (g->cu_failed[0]) { /* another job of the pool was given up on: so is this one, at once (this
                            * thread alone writes cu_failed) */
        cuda_give_up(e, j, g->cu_failed, 0);
        return;
    }
    if (j->cu_error && !j->cu_done) { /* nothing of it reached the stream */
        cuda_end_failed_issue(e, j);
        return;
    }
    int rc = cu->ctx_set_current(g->cu_ctx);
    uint32_t before = j->li;
    if (!rc && j->cu_done) { /* a write's end, or the marker behind a failed issue */
        rc = cu->event_query(j->cu_done);
        if (rc == KV_CU_SUCCESS) {
            cu->event_destroy(j->cu_done);
            j->cu_done = NULL;
            if (j->cu_error) {
                cuda_end_failed_issue(e, j);
                return;
            }
            j->li = j->nl;
        }
    } else if (!rc) {
        int64_t nlayers = g->lim.num_layers;
        while (j->li < j->nl &&
               (rc = cu->event_query(g->cu_events[(int64_t)j->cu_slot * nlayers + j->local[j->li]])) == KV_CU_SUCCESS)
            j->li++;
    }
    if (rc != KV_CU_SUCCESS && rc != KV_CU_NOT_READY) {
        cuda_give_up(e, j, "looking at its copies' events failed", rc);
        return;
    }
    if (j->li == before) {
        if (t - j->cu_progress_ns >= g->cu_wait_ns) {
            char why[160];
            snprintf(why, sizeof why, "its GPU copies made no progress for %.3g s (--cuda-wait-seconds): an "
                     "event they wait on, such as the engine's ready event, has not fired", (double)g->cu_wait_ns / 1e9);
            cuda_give_up(e, j, why, 0);
        }
        return;
    }
    j->cu_progress_ns = e->cu_progress_ns = t;
    if (j->load && before == 0)
        observe(e, H_FIRST, t - j->arrival_ns);
    if (j->li == j->nl) {
        finish(e, j, 0, NULL, !j->cu_quiet);
        return;
    }
    if (!j->cu_quiet) {
        publish_progress(e, j, 0);
        if (t - j->last_pub_ns >= e->progress_interval_ns) {
            j->last_pub_ns = t;
            ring_step(j->lane, j->slot);
        }
    }
}

/* A CUDA job leaves the jobs: its own event, if it still has one, goes (destroying an event
 * whose record is pending is safe: the driver frees it once it completes). */
static void cuda_forget(Engine *e, Job *j) {
    if (j->cuda) {
        j->gate->cu_queued -= j->cu_ops;
        e->cu_queued -= j->cu_ops;
        j->cu_ops = 0;
    }
    if (j->cu_kernel && j->cu_args_len) { /* its span goes back: the ring's tail is the oldest span left */
        Gate *g = j->gate;
        int64_t tail = g->cu_args_head;
        for (Job *o = e->jobs; o; o = o->next)
            if (o != j && o->gate == g && o->cu_kernel && o->cu_args_len) {
                tail = o->cu_args_at;
                break;
            }
        if (tail == g->cu_args_head) /* none left: the next span starts at the area's start */
            tail = g->cu_args_head = 0;
        g->cu_args_tail = tail;
        j->cu_args_len = 0;
    }
    if (j->cuda && j->cu_done) {
        Gate *g = j->gate;
        g->cu.ctx_set_current(g->cu_ctx);
        g->cu.event_destroy(j->cu_done);
        j->cu_done = NULL;
    }
}

/* How long the thread may nap before it looks at the CUDA jobs' events again: 0 while any job
 * has CPU work (or no job at all), or soon after the last progress; then a growing part of the
 * time since, up to CU_NAP_MAX_NS, as the loop's waits on the GPU do (media/cuda/waits.py). */
static int64_t cuda_nap_ns(Engine *e) {
    int any = 0;
    if (!e->jobs)
        return 0;
    for (Job *j = e->jobs; j; j = j->next) {
        if (!j->cuda)
            return 0;
        if (!j->cu_stalled)
            any = 1;
    }
    if (!any)
        return CU_NAP_MAX_NS; /* only given-up jobs, held until their gates close */
    int64_t since = now_ns() - e->cu_progress_ns;
    if (since < CU_SPIN_NS)
        return 0;
    int64_t nap = since / 4;
    return nap < 20000 ? 20000 : nap > CU_NAP_MAX_NS ? CU_NAP_MAX_NS : nap;
}
