/* A lane Get served whole on the plane (try_get), and a Lookup answered there (try_answer): their
 * ends posted back to the loop. A part of kvlane.c. */

static void publish_progress(Engine *e, Job *j, uint32_t flags);
static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message);
static const int64_t never_stopped = 0; /* the stop word of a Get served here: its gate's close stops it */

/* Room for one more item of `size` bytes in the array *items (of *cap, *n posted), kept until it
 * is posted (*unposted counts those kept); 0: out of memory. All of them hand_mu's, which it takes. */
static int reserve_room(Engine *e, void **items, size_t *cap, const size_t *n, size_t *unposted, size_t size) {
    pthread_mutex_lock(&e->hand_mu);
    int room = 1;
    if (*cap < *n + *unposted + 1) {
        size_t more = 2 * (*n + *unposted + 1) + 16;
        void *d = realloc(*items, more * size);
        if (d) {
            *items = d;
            *cap = more;
        } else {
            room = 0;
        }
    }
    if (room)
        (*unposted)++;
    pthread_mutex_unlock(&e->hand_mu);
    return room;
}

/* The most ends of calls served here that the loop has yet to settle: past it, a call is handed to
 * the loop (which settles as it serves), so that a client calling back to back never leaves the
 * loop more ends to settle at one wake-up than this. */
#define MAX_UNSETTLED_ENDS 256

/* Room for one more GetEnd, kept until it is posted; 0: out of memory, or MAX_UNSETTLED_ENDS
 * posted already and waiting for the loop (the Gets still copying, not posted yet, do not count). */
static int reserve_get_end(Engine *e) {
    pthread_mutex_lock(&e->hand_mu);
    int full = e->ngets >= MAX_UNSETTLED_ENDS;
    pthread_mutex_unlock(&e->hand_mu);
    return !full && reserve_room(e, (void **)&e->gets, &e->capgets, &e->ngets, &e->unposted_gets, sizeof(GetEnd));
}

static void unreserve_get_end(Engine *e) {
    pthread_mutex_lock(&e->hand_mu);
    e->unposted_gets--;
    pthread_mutex_unlock(&e->hand_mu);
}

/* A Get served here has ended: its end posted back (its ids with it: the loop lets the pages go),
 * the gate's count of its jobs given back. The loop is woken by the first end it has not taken
 * (it takes every one posted by then, take_gets, after it drained the eventfd): ends posted while
 * it settles earlier ones wait for it without a wake-up each, and are settled together. */
static void post_get_end(Engine *e, Job *j, int status) {
    Gate *g = j->gate;
    pthread_mutex_lock(&e->hand_mu);
    int first = e->ngets == 0;
    GetEnd *d = &e->gets[e->ngets++]; /* room kept by reserve_get_end */
    d->token = g->cache_token;
    d->gid = g->cache_gid;
    d->found = j->found;
    d->misses = j->misses;
    d->ids = j->ids;
    d->nids = j->store ? j->nids : (int64_t)j->found * (g->space ? g->nparts : 1);
    d->status = status;
    d->layers = j->li;
    d->nbytes = status == DONE_OK ? (int64_t)j->nl * j->bytes_per_layer : 0;
    d->kind = j->get ? END_GET : j->store ? END_STORE : j->end_kind; /* a Get's pages are held; a Lookup's not */
    e->unposted_gets--;
    pthread_mutex_unlock(&e->hand_mu);
    j->ids = NULL;
    pthread_mutex_lock(&g->mu);
    g->c_inflight--;
    pthread_mutex_unlock(&g->mu);
    if (first)
        wake(e->notify_fd);
}

/* The runs of a cache page at arena offset `off` and device page `dev` (`ps` tokens of `tb` bytes a
 * (layer, part)): one where the device's tokens are contiguous, else one a token; their count. */
static int64_t page_runs(Run *runs, int64_t off, int64_t dev, int64_t ps, int64_t tb, int contiguous) {
    for (int64_t t = 0; t < (contiguous ? 1 : ps); t++)
        runs[t] = (Run){off + t * tb, dev * ps + t, contiguous ? ps : 1};
    return contiguous ? 1 : ps;
}

/* The end of a call walked here that copies nothing (a Lookup, a Put of keys all stored), posted
 * at once: its registration's lease renewed, as every call renews it, and the end counted among
 * the gate's jobs until it is posted; job j freed. */
static void post_walked(Engine *e, Job *j, int64_t arrival) {
    Gate *g = j->gate;
    pthread_mutex_lock(&g->mu);
    g->last_call_ns = arrival;
    g->c_inflight++;
    pthread_mutex_unlock(&g->mu);
    post_get_end(e, j, DONE_OK);
    job_free(j);
}

/* Tries to serve slot i, a lane Get (protobuf), whole on this thread: read and checked (get.h), its
 * keys walked in the cache and their pages held (cache.h), then copied as a Load is, answering the
 * slot with the pages found. 1 if it did (or answered a Get that found nothing); 0: the loop's. */
static int try_get(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), ps = g->lim.page_size, tb = g->token_bytes;
    unsigned char *buf = malloc(n ? n : 1);
    int64_t *dev = malloc(sizeof(int64_t) * (size_t)g->cache_max_keys);
    int32_t *local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
    uint64_t *words = NULL;
    int64_t *ids = NULL, *offs = NULL, m = -1;
    Job *j = NULL;
    int ok = buf && dev && local, reserved = 0, counted = 0;
    cache_call q = {0};
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_GET, buf, n, &q, dev, local);
    }
    int64_t nkeys = q.nkeys;
    uint32_t nl = q.nl;
    int64_t bytes_per_layer = nkeys * ps * tb * g->parts;
    if (ok && g->cache_split_bytes && bytes_per_layer * (int64_t)nl >= g->cache_split_bytes)
        ok = 0; /* were every key found, the copy workers would split it: the loop's */
    if (ok) { /* the words before the lock: a digest of wide keys takes a while */
        words = malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys);
        ids = malloc(sizeof(int64_t) * (size_t)nkeys);
        offs = malloc(sizeof(int64_t) * (size_t)nkeys);
        j = calloc(1, sizeof(Job));
        ok = words && ids && offs && j && (reserved = reserve_get_end(e));
    }
    if (ok) {
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
        ok = counted = take_turn(g, arrival);
    }
    if (ok) {
        m = cache_walk_hold(c, words, (uint8_t)q.key_bytes, nkeys, gid, (int64_t)g->lim.num_layers * g->parts,
                            g->cache_lp_stride, ids, offs, 1, c->whole, 0);
        ok = m >= 0;
    }
    int64_t nr = 0;
    Run *runs = NULL;
    if (ok && m > 0) { /* a run a page where the device's tokens are contiguous, else a token */
        int contiguous = g->dev_stride == tb;
        runs = malloc(sizeof(Run) * (size_t)(contiguous ? m : m * ps));
        for (int64_t k = 0; runs && k < m; k++)
            nr += page_runs(runs + nr, offs[k], dev[k], ps, tb, contiguous);
        if (!runs) /* out of memory after the holds: the pages go back with its end, the loop answers */
            ok = 0;
    }
    free(buf);
    free(words);
    free(offs);
    free(dev);
    if (!ok) {
        if (m > 0) { /* held already: its pages go back with its end, unanswered, and the loop serves it */
            j->get = 1;
            j->gate = g;
            j->ids = ids;
            j->found = (uint32_t)m;
            j->local = local;
            post_get_end(e, j, DONE_HALTED);
            job_free(j);
            handoff(e, l, i, RPC_GET);
            return 1;
        }
        if (counted) {
            pthread_mutex_lock(&g->mu);
            g->c_inflight--;
            pthread_mutex_unlock(&g->mu);
        }
        if (reserved)
            unreserve_get_end(e);
        free(ids);
        free(local);
        free(j);
        return 0;
    }
    j->lane = l;
    j->slot = i;
    j->gate = g;
    j->load = j->answers = j->get = 1;
    j->dependent = 1; /* behind every earlier job of its gate, as the loop's answering copies */
    j->ids = ids;
    j->found = (uint32_t)m;
    j->misses = nkeys - m;
    j->local = local;
    j->nl = nl;
    j->runs = runs;
    j->nruns = nr;
    j->ndev = m * ps;
    j->bytes_per_layer = m * ps * tb * g->parts;
    j->stream = kv_streams(1, j->bytes_per_layer * (int64_t)nl);
    j->host = c->arena;
    j->lp_stride = g->cache_lp_stride;
    j->stop = &never_stopped;
    j->arrival_ns = arrival;
    j->deadline_ns = q.timeout_ms ? arrival + (int64_t)q.timeout_ms * 1000000 : 0;
    __atomic_add_fetch(&e->plane_gets, 1, __ATOMIC_RELAXED);
    if (m == 0) { /* nothing found: answered now, as the loop answers one */
        j->nl = 0;
        post_get_end(e, j, DONE_OK);
        answer_slot(e, j, 0, NULL);
        job_free(j);
        return 1;
    }
    /* Step 1, the pages found, before any layer (the RPC's first message); rung only for a copy that
     * takes a while or waits behind others, as the loop's answering copies are. */
    publish_progress(e, j, 0);
    if (j->bytes_per_layer * (int64_t)j->nl > QUIET_FIRST_BYTES || e->jobs || e->paused)
        ring_step(l, i);
    else
        j->last_pub_ns = now_ns();
    enqueue(e, j);
    return 1;
}

/* Answers unary call i (its response, status OK) as the loop's Lane.answer_now does. */
static void answer_unary(Engine *e, Lane *l, int i, const unsigned char *response, uint32_t len, int64_t arrival) {
    char *s = slot_at(l, i);
    int64_t us = (now_ns() - arrival) / 1000;
    put32(s + BUSY_AT, us < 1 ? 1u : us > (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)us);
    memcpy(s + RESPONSE_AT, response, len);
    put32(s + 60, FLAG_JOB_ENDED);
    put32(s + 20, 0);
    put32(s + 24, len);
    put32(s + 28, 0);
    memcpy(s + 64, s + 8, 8); /* done_seq: the seq the client wrote (TAKEN: it is ours) */
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    __atomic_add_fetch(&e->served, 1, __ATOMIC_RELAXED);
    set_state(s, ST_DONE);
    ring_done(l, i);
}

/* Tries to answer slot i, an engine's Lookup of its own part (protobuf), whole on this thread: read
 * and checked (get.h), its keys walked in the cache (nothing held) and answered with the pages
 * found. 1 if it did; 0: the loop's. It copies nothing, so it waits for nothing of its
 * registration. In a cache with no tier below or beside host memory (or of host memory only,
 * which asks none), it leaves the loop nothing to settle: its pages are made recent in the walk,
 * under the cache's lock, and its hits and misses are counted in its gate (Gate.take_lookups,
 * which the loop harvests with the gate's transfers: before a Stats, a scrape, a release), so that
 * however fast engines look up, a Lookup costs the loop nothing and none is handed to the loop for
 * want of room for its end. Else (a tier's copies are made recent by the loop too,
 * CacheOps._touch_below) its end is posted back, and the loop makes them recent and counts the
 * hits and misses; as is a scheduler's Lookup of the whole space on a space's gate, walked in each
 * of its parts (cache_walk_space), its end posted with every part's pages. */
static int try_answer(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), m = -1;
    unsigned char *buf = malloc(n ? n : 1);
    cache_call q = {0};
    int ok = buf != NULL;
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_LOOKUP, buf, n, &q, NULL, NULL);
    }
    int64_t nkeys = q.nkeys, nparts = g->space ? g->nparts : 1; /* (set_space bounds nkeys * nparts) */
    /* A Lookup of host memory only asks no tier: its partial hit is whole too */
    int whole = c->whole && !q.memory_only, here = !g->space && !whole;
    uint64_t *words = ok ? malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys) : NULL;
    int64_t *ids = ok ? malloc(sizeof(int64_t) * (size_t)(nkeys * nparts)) : NULL;
    int64_t *offs = ok ? malloc(sizeof(int64_t) * (size_t)nkeys) : NULL;
    Job *j = ok && !here ? calloc(1, sizeof(Job)) : NULL;
    ok = ok && words && ids && offs && (here || (j && reserve_get_end(e)));
    if (ok) {
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
        if (g->space)
            m = cache_walk_space(c, words, (uint8_t)q.key_bytes, nkeys, g->space_gids, g->nparts, ids, offs, whole);
        else
            m = cache_walk_hold(c, words, (uint8_t)q.key_bytes, nkeys, gid, (int64_t)g->lim.num_layers * g->parts,
                                g->cache_lp_stride, ids, offs, 0, whole, here);
        ok = m >= 0;
        if (!ok && !here)
            unreserve_get_end(e);
    }
    free(buf);
    free(words);
    free(offs);
    if (!ok || here) {
        free(ids);
        free(j);
    }
    if (!ok)
        return 0;
    if (here) { /* before the answer, so that a Stats after it counts the hits; its lease renewed */
        pthread_mutex_lock(&g->mu);
        g->last_call_ns = arrival;
        g->lookup_hits += (uint64_t)m;
        g->lookup_misses += (uint64_t)(nkeys - m);
        pthread_mutex_unlock(&g->mu);
    } else {
        j->gate = g;
        j->ids = ids;
        j->found = (uint32_t)m;
        j->misses = nkeys - m;
        j->end_kind = q.memory_only ? END_LOOKUP_HOST : END_LOOKUP;
        post_walked(e, j, arrival); /* before the answer: a Stats after it counts the hits */
    }
    unsigned char resp[16];
    uint32_t len = 0;
    if (m) /* LookupResponse{pages}: field 1 (nothing for 0, as protobuf writes it) */
        len = pb_varint_field(resp, 0x08, (uint64_t)m);
    observe(e, H_LOOKUP, now_ns() - arrival);
    __atomic_add_fetch(&e->plane_lookups, 1, __ATOMIC_RELAXED);
    if (g->space)
        __atomic_add_fetch(&e->plane_space_lookups, 1, __ATOMIC_RELAXED);
    answer_unary(e, l, i, resp, len, arrival);
    return 1;
}
