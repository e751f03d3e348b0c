/* A lane's binary Write or Load taken as a job (try_job): a job's pages and write marks, whether a
 * CUDA gate's job is the plane's, and what every other part uses of a slot: its words (slot_at,
 * put32, ring_done, wake), an error's answer, the hand-off to the loop; and the latency histograms'
 * count (observe). A part of kvlane.c. */

static void observe(Engine *e, int h, int64_t ns) {
    double s = (double)ns / 1e9;
    int b = 0;
    while (b < e->nedges && s > e->edges[b])
        b++;
    pthread_mutex_lock(&e->stat_mu);
    e->hist[h][b]++;
    e->hsum[h] += s;
    pthread_mutex_unlock(&e->stat_mu);
}

static inline char *slot_at(Lane *l, int i) { return l->ring + HEADER_BYTES + (size_t)i * SLOT_BYTES; }

/* By when a write of slot i must end to be done (Job.write_by_ns): its deadline, or the slot's
 * expiry word (when its client stops waiting) if that is sooner. */
static int64_t write_by(Lane *l, int i, int64_t deadline) {
    uint64_t expires;
    memcpy(&expires, slot_at(l, i) + EXPIRES_AT, 8);
    if (expires && expires <= (uint64_t)INT64_MAX && (!deadline || (int64_t)expires < deadline))
        return (int64_t)expires;
    return deadline;
}

static inline void put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
/* A protobuf varint field (its one-byte tag, then v) at p: its length (at most 11 bytes). */
static uint32_t pb_varint_field(unsigned char *p, unsigned char tag, uint64_t v) {
    uint32_t n = 0;
    p[n++] = tag;
    do {
        unsigned char b = v & 0x7F;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}
static inline void put64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t state_of(char *slot) { return __atomic_load_n((uint32_t *)slot, __ATOMIC_ACQUIRE); }
static inline void set_state(char *slot, uint32_t s) { __atomic_store_n((uint32_t *)slot, s, __ATOMIC_RELEASE); }

/* Rings slot i's done doorbell after its state or step word was stored; on a quiet lane only if
 * the client sleeps on it. The client stores its waiting word, then looks at those words, then
 * sleeps; this thread stored them, then looks at the waiting word: with a full fence on each side
 * one of the two sees the other's store (docs/lane.md, "Ringing only a sleeper"). The word is the
 * client's to change: one that lies only misses its own wake-ups. ``step``: for a step of a call
 * still running (a layer landed, its pages found, its events recorded), which a client sleeping
 * for the call's end only (its word WAIT_END) is not rung for: each such wake-up would cost a
 * system call here and a wake-up there for nothing (3% of a 64 MiB load's time on a 2-core VM,
 * docs/performance.md). */
static void ring(Lane *l, int i, int step) {
    if (l->quiet) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint32_t waiting = __atomic_load_n((uint32_t *)(slot_at(l, i) + WAITING_AT), __ATOMIC_RELAXED);
        if (!waiting || (step && waiting == WAIT_END))
            return;
    }
    (void)!send(l->done_fd[i], "d", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void ring_done(Lane *l, int i) { ring(l, i, 0); }
static void ring_step(Lane *l, int i) { ring(l, i, 1); }

static void wake(int fd) {
    uint64_t one = 1;
    (void)!write(fd, &one, 8);
}

/* Answers slot i here with an error (the request never ran). */
static void answer_error(Lane *l, int i, uint32_t code, const char *message) {
    char *s = slot_at(l, i);
    uint32_t n = (uint32_t)strlen(message);
    memcpy(s + ERROR_AT, message, n);
    put32(s + 60, FLAG_JOB_ENDED);
    put32(s + 20, code);
    put32(s + 24, 0);
    put32(s + 28, n);
    memcpy(s + 64, s + 8, 8);
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    set_state(s, ST_DONE);
    ring_done(l, i);
}

/* Hands slot i of the lane over to the loop (Lane.take); slot -1: the peer of a space's lane has
 * closed its end of the submit doorbell (Lane.peer_closed). */
static void handoff(Engine *e, Lane *l, int i, uint32_t rpc) {
    /* A copy the loop serves keeps the plane from the registration's copies until it ends (the
     * two never copy for one registration at once); a request that copies nothing (a Lookup, an
     * id no one knows) holds nothing off. */
    int counted = !l->gate->space && rpc >= 1 && rpc <= RPC_COPIES_LAST; /* a space's lane copies nothing */
    pthread_mutex_lock(&e->hand_mu);
    if (e->nhand == e->caphand) {
        size_t cap = e->caphand ? 2 * e->caphand : 64;
        Handoff *h = realloc(e->hand, cap * sizeof(Handoff));
        if (h) {
            e->hand = h;
            e->caphand = cap;
        }
    }
    int room = e->nhand < e->caphand;
    pthread_mutex_unlock(&e->hand_mu);
    if (!room) { /* out of memory: said, not dropped (a peer gone: its process's exit is watched too) */
        if (i >= 0)
            answer_error(l, i, CODE_RESOURCE_EXHAUSTED, "the daemon is out of memory for this request: retry");
        return;
    }
    if (counted) {
        pthread_mutex_lock(&l->gate->mu);
        l->gate->py_inflight++;
        pthread_mutex_unlock(&l->gate->mu);
    }
    pthread_mutex_lock(&e->hand_mu);
    if (e->nhand < e->caphand) { /* only this thread adds: the room found above is still there */
        e->hand[e->nhand].lane_key = l->key;
        e->hand[e->nhand].slot = i;
        e->hand[e->nhand].rpc = rpc;
        e->hand[e->nhand].counted = counted;
        e->nhand++;
    }
    __atomic_add_fetch(&e->handed, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&e->hand_mu);
    wake(e->notify_fd);
}

static void job_free(Job *j) {
    free(j->words);
    free(j->ids);
    free(j->pages);
    free(j->runs);
    free(j->local);
    free(j);
}

static int64_t layer_local_bytes(Gate *g) { return g->lim.page_size * g->token_bytes; }

/* Builds a job from an accepted request; NULL if memory ran out (then Python answers). */
static Job *make_job(Lane *l, int i, const kv_request *r, int64_t *pages, int32_t *local, uint32_t nl,
                     int64_t arrival) {
    Gate *g = l->gate;
    Job *j = calloc(1, sizeof(Job));
    if (!j) {
        free(pages);
        free(local);
        return NULL;
    }
    int64_t ps = g->lim.page_size;
    j->lane = l;
    j->slot = i;
    j->gate = g;
    j->load = r->kind == KV_KIND_LOAD;
    j->npages = r->n_pages;
    j->pages = pages;
    j->local = local;
    j->nl = nl;
    j->ndev = j->npages * ps;
    /* Runs of consecutive device tokens within a page: counted first, so that a request of whole
     * device pages costs one run a page, not one a token. */
    int contiguous = g->dev_stride == g->token_bytes;
    int64_t nr = 0;
    for (int64_t k = 0; k < j->npages; k++)
        for (int64_t t = 0; t < ps; t++)
            if (t == 0 || !contiguous || kv_dev_token(r, ps, k * ps + t) != kv_dev_token(r, ps, k * ps + t - 1) + 1)
                nr++;
    j->runs = malloc(sizeof(Run) * (size_t)nr);
    if (!j->runs) {
        job_free(j); /* pages and local with it */
        return NULL;
    }
    nr = 0;
    for (int64_t k = 0; k < j->npages; k++) {
        for (int64_t t = 0; t < ps; t++) {
            int64_t d = kv_dev_token(r, ps, k * ps + t);
            if (t > 0 && contiguous && d == j->runs[nr - 1].dev_tok + j->runs[nr - 1].ntok) {
                j->runs[nr - 1].ntok++;
                continue;
            }
            j->runs[nr].host_off = pages[k] * g->page_bytes + t * g->token_bytes;
            j->runs[nr].dev_tok = d;
            j->runs[nr].ntok = 1;
            nr++;
        }
    }
    j->nruns = nr;
    j->bytes_per_layer = j->ndev * g->token_bytes * g->parts;
    j->stream = kv_streams(j->load, j->bytes_per_layer * (int64_t)j->nl);
    j->host = g->host_base;
    j->lp_stride = layer_local_bytes(g);
    j->arrival_ns = arrival;
    j->deadline_ns = r->timeout_ms ? arrival + (int64_t)r->timeout_ms * 1000000 : 0;
    if (!j->load)
        j->write_by_ns = write_by(l, i, j->deadline_ns);
    return j;
}

/* Whether every page and slot of a load is free of unfinished writes (of this plane). */
static int touches_writes(Job *j) {
    Gate *g = j->gate;
    for (int64_t k = 0; k < j->npages; k++)
        if (g->wpages[j->pages[k]])
            return 1;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = j->runs[k].dev_tok; t < j->runs[k].dev_tok + j->runs[k].ntok; t++)
            if (g->wdev[t])
                return 1;
    return 0;
}

static void mark_writes(Job *j, int by) {
    Gate *g = j->gate;
    for (int64_t k = 0; k < j->npages; k++)
        g->wpages[j->pages[k]] += by;
    for (int64_t k = 0; k < j->nruns; k++)
        for (int64_t t = j->runs[k].dev_tok; t < j->runs[k].dev_tok + j->runs[k].ntok; t++)
            g->wdev[t] += by;
}

/* Job j joins the jobs, last in arrival order. */
static void enqueue(Engine *e, Job *j) {
    Job **tail = &e->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    j->seq = ++e->next_seq;
    __atomic_add_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
}

/* A call of the gate's that copies takes its turn here (try_get, try_put): 1 if the gate is open
 * and no copy of its registration is the loop's (its copies keep their order); then it counts
 * among the gate's jobs and renews the registration's lease. */
static int take_turn(Gate *g, int64_t arrival) {
    pthread_mutex_lock(&g->mu);
    int ok = !g->closed && g->py_inflight == 0;
    if (ok) {
        g->c_inflight++;
        g->last_call_ns = arrival;
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

/* Whether the plane takes job j of a CUDA gate (set_cuda), and if so makes it a CUDA job: its
 * copies few enough to issue one by one, else the copy kernel's (set_cuda_kernels) with room for
 * its arguments; its driver calls within the queue bounds; its ready event one the loop opened;
 * and the pool's GPU work not given up on. */
static int cuda_takes(Engine *e, Gate *g, Job *j, const kv_request *r) {
    int packed = g->dev_stride == g->token_bytes; /* else a run is a copy a token (cuda_issue) */
    int64_t pieces = j->nruns;
    for (int64_t k = 0; !packed && k < j->nruns; k++) /* (make_job joins no such run today) */
        pieces += j->runs[k].ntok - 1;
    int64_t copies = pieces * (int64_t)j->nl * g->parts;
    int dma = copies <= g->cu_max_copies;
    if (dma && copies > g->cu_small_copies)
        for (int64_t k = 0; k < j->nruns && dma; k++)
            dma = (packed ? j->runs[k].ntok : 1) * g->token_bytes >= g->cu_min_copy_bytes;
    int64_t ops = (r->ready_len ? 1 : 0) + (j->load ? j->nl : 1); /* the wait, the records */
    if (dma) {
        ops += copies;
    } else { /* the copy kernel's: a launch per layer (a load) or one (a write), token rows */
        if (!g->cu_kernels[0])
            return 0;
        int64_t need = 16 * ((int64_t)j->nl * g->parts + j->ndev); /* bases, offsets: both sides */
        int64_t pos = g->cu_args_head % g->cu_args_bytes;
        int64_t pad = pos + need > g->cu_args_bytes ? g->cu_args_bytes - pos : 0; /* a span never wraps */
        if (g->cu_args_head + pad + need - g->cu_args_tail > g->cu_args_bytes)
            return 0;
        j->cu_kernel = 1;
        j->cu_args_want = pad + need;
        j->cu_args_pos = pad ? 0 : pos; /* nothing else is handed out before it is launched */
        ops += j->load ? j->nl : 1;
    }
    if (g->cu_queued + ops > g->cu_max_queued || e->cu_queued + ops > CU_PLANE_QUEUED_MAX)
        return 0;
    void *ready = NULL;
    pthread_mutex_lock(&g->mu);
    int ok = !g->cu_failed[0];
    if (ok && r->ready_len) {
        for (int k = 0; k < g->cu_nready && !ready; k++)
            if (memcmp(g->cu_ready[k], r->ready, 64) == 0)
                ready = g->cu_ready_ev[k];
        ok = ready != NULL;
    }
    pthread_mutex_unlock(&g->mu);
    if (!ok)
        return 0;
    j->cuda = 1;
    j->cu_slot = r->event_slot;
    j->cu_ops = ops;
    j->cu_ready = ready;
    return 1;
}

static void cuda_issue(Engine *e, Job *j);

/* Tries to serve slot i as a job of this plane: 1 if it became one. */
static int try_job(Engine *e, Lane *l, int i, uint32_t rpc, uint32_t n) {
    Gate *g = l->gate;
    if ((rpc != RPC_WRITE_B && rpc != RPC_LOAD_B) || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns();
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf)
        return 0;
    memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
    kv_request r;
    int ok = kv_parse(buf, n, &r) && (r.kind == KV_KIND_WRITE) == (rpc == RPC_WRITE_B);
    int64_t *pages = NULL;
    int32_t *local = NULL;
    uint32_t nl = 0;
    Job *j = NULL;
    if (ok) {
        pages = malloc(sizeof(int64_t) * ((size_t)r.n_pages + 1));
        local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
        /* The marks are the gate's scratch, shared with Gate.check (tests) under check_mu. */
        pthread_mutex_lock(&g->check_mu);
        ok = pages && local && kv_accept(&r, &g->lim, pages, local, &nl);
        pthread_mutex_unlock(&g->check_mu);
    }
    if (ok)
        j = make_job(l, i, &r, pages, local, nl, arrival); /* owns pages and local, freed or not */
    if (j && g->cuda && !cuda_takes(e, g, j, &r)) {
        job_free(j);
        j = NULL;
        ok = 0;
        pages = NULL; /* freed with the job */
        local = NULL;
    }
    free(buf);
    if (!j) {
        if (!ok) {
            free(pages);
            free(local);
        }
        return 0;
    }
    pthread_mutex_lock(&g->mu);
    ok = !g->closed && g->py_inflight == 0;
    for (int64_t k = 0; ok && k < j->npages; k++)
        ok = g->lim.owned[j->pages[k]] != 0;
    if (ok) {
        for (int64_t k = 0; k < j->npages; k++)
            g->busy[j->pages[k]]++;
        g->c_inflight++;
        g->last_call_ns = arrival;
    }
    pthread_mutex_unlock(&g->mu);
    if (!ok) {
        job_free(j);
        return 0;
    }
    enqueue(e, j);
    if (j->cuda) { /* its stream orders it: no write marks (a CUDA gate has no other kind of job) */
        cuda_issue(e, j);
        return 1;
    }
    j->dependent = j->load ? touches_writes(j) : 1;
    if (!j->load)
        mark_writes(j, 1);
    return 1;
}
