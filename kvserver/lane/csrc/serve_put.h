/* A lane Put served whole on the plane (try_put): answered at once where every key is stored, else
 * copied into the stash's pages as a write. A part of kvlane.c. */

/* PutResponse{stored, present, dropped, bytes} (fields 1 to 4; none of 0, as protobuf writes them)
 * at p: its length (at most 44 bytes). */
static uint32_t put_response(unsigned char *p, int64_t stored, int64_t present, int64_t dropped, int64_t nbytes) {
    uint32_t len = 0;
    if (stored)
        len += pb_varint_field(p + len, 0x08, (uint64_t)stored);
    if (present)
        len += pb_varint_field(p + len, 0x10, (uint64_t)present);
    if (dropped)
        len += pb_varint_field(p + len, 0x18, (uint64_t)dropped);
    if (nbytes)
        len += pb_varint_field(p + len, 0x20, (uint64_t)nbytes);
    return len;
}

/* Tries to serve slot i, a lane Put (protobuf), whole on this thread: read and checked as a Get of
 * its keys into its device pages (get.h), its keys walked in the gate's part under the cache's lock.
 * Every key stored already: answered present at once, its end counting them (END_PUT). Keys the
 * part lacks, as many as the gate's stash has pages (Engine.stash): those pages taken from it under
 * the same hold of the lock, and the keys' device pages copied into them as a write job of the gate
 * (loads first, writes in turns, after the registration's earlier copies), then filed under the part
 * and answered (finish_put). 0: the loop's, nothing taken: a key another Put is still writing (the
 * loop waits for it), a key of over 32 bytes (its bytes are the loop's to keep, for KV events), a
 * stash too small, a copy of the registration on the loop's side, the lock the loop's, or anything
 * the check refuses. */
static int try_put(Engine *e, Lane *l, int i, uint32_t n) {
    Gate *g = l->gate;
    Cache *c = e->cache;
    int32_t gid = __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE);
    if (!c || gid < 0 || g->space || n > REQUEST_BYTES || __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE))
        return 0;
    int64_t arrival = now_ns(), ps = g->lim.page_size, tb = g->token_bytes;
    int64_t chunks = (int64_t)g->lim.num_layers * g->parts, lp = g->cache_lp_stride;
    unsigned char *buf = malloc(n ? n : 1);
    int64_t *dev = malloc(sizeof(int64_t) * (size_t)g->cache_max_keys);
    int32_t *local = malloc(sizeof(int32_t) * (size_t)g->lim.num_layers);
    cache_call q = {0};
    int ok = buf && dev && local;
    if (ok) {
        memcpy(buf, slot_at(l, i) + REQUEST_AT, n); /* a private copy: the peer may scribble */
        ok = check_cache_call(g, RPC_PUT, buf, n, &q, dev, local);
    }
    int64_t nkeys = ok ? q.nkeys : 0, present = 0, missing = 0;
    int contiguous = g->dev_stride == tb;
    uint64_t *words = ok ? malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)nkeys) : NULL, *mwords = NULL;
    int64_t *found = ok ? malloc(sizeof(int64_t) * (size_t)nkeys) : NULL, *taken = NULL;
    Run *runs = NULL;
    Job *j = ok ? calloc(1, sizeof(Job)) : NULL;
    int reserved = 0;
    ok = ok && words && found && j && (reserved = reserve_get_end(e));
    /* the copy's memory before the lock, for as many missing keys as the stash has pages now (a
     * stash that grows before the lock is taken leaves the keys past that to the loop) */
    int64_t cap = ok ? __atomic_load_n(&g->nstash, __ATOMIC_RELAXED) : 0;
    cap = cap < nkeys ? cap : nkeys;
    if (ok && cap > 0) {
        mwords = malloc(sizeof(uint64_t) * KV_KEY_WORDS * (size_t)cap);
        taken = malloc(sizeof(int64_t) * (size_t)cap);
        runs = malloc(sizeof(Run) * (size_t)(contiguous ? cap : cap * ps));
        ok = mwords && taken && runs;
    }
    if (ok)
        kv_keys_words(q.keys, (int64_t)q.key_bytes, nkeys, words);
    free(buf);
    int64_t nr = 0;
    if (ok && cache_try_lock(c)) {
        ok = c->open;
        if (ok)
            kv_index_find(&c->ix, words, NULL, (uint8_t)q.key_bytes, nkeys, gid, found);
        for (int64_t k = 0; ok && k < nkeys; k++) {
            int64_t id = found[k];
            if (id < 0)
                missing++;
            else if (id >= c->pg.npages || c->pg.state[id] != KV_COMMITTED)
                ok = 0; /* being written by another Put (or a corrupt table): the loop's */
            else
                present++;
        }
        if (ok && missing) {
            ok = q.key_bytes <= KV_WORD_BYTES && missing <= g->nstash && missing <= cap;
            if (q.key_bytes <= KV_WORD_BYTES && missing > g->nstash && missing <= g->stash_full)
                g->stash_short = 1; /* (a Put the plane would have stored: the loop fills the stash then) */
            for (int64_t k = 0; ok && k < missing; k++) { /* (the loop gave them: checked all the same) */
                int64_t id = g->stash[g->nstash - 1 - k], off = id >= 0 && id < c->pg.npages ? c->pg.offset[id] : -1;
                ok = off >= 0 && off <= c->arena_bytes && (c->arena_bytes - off) / lp >= chunks;
            }
            ok = ok && take_turn(g, arrival);
            for (int64_t k = 0, m = 0; ok && k < nkeys; k++) {
                if (found[k] >= 0)
                    continue;
                int64_t id = g->stash[--g->nstash], off = c->pg.offset[id];
                taken[m] = id;
                memcpy(mwords + KV_KEY_WORDS * m, words + KV_KEY_WORDS * k, KV_WORD_BYTES);
                nr += page_runs(runs + nr, off, dev[k], ps, tb, contiguous);
                m++;
            }
        }
        pthread_mutex_unlock(&c->mu);
    } else {
        ok = 0;
    }
    free(words);
    free(found);
    free(dev);
    if (!ok) {
        if (reserved)
            unreserve_get_end(e);
        free(mwords);
        free(taken);
        free(runs);
        free(local);
        free(j);
        return 0;
    }
    j->gate = g;
    j->misses = present;
    j->arrival_ns = arrival;
    if (!missing) { /* every key stored already: nothing taken or copied, answered present now */
        j->found = (uint32_t)present;
        j->end_kind = END_PUT;
        post_walked(e, j, arrival); /* before the answer: a Stats after it counts them */
        free(local);
        free(mwords);
        free(taken);
        free(runs);
        unsigned char resp[48];
        observe(e, H_PUT, now_ns() - arrival);
        __atomic_add_fetch(&e->plane_puts, 1, __ATOMIC_RELAXED);
        answer_unary(e, l, i, resp, put_response(resp, 0, present, 0, 0), arrival);
        return 1;
    }
    j->lane = l;
    j->slot = i;
    j->dependent = 1; /* a write: behind every earlier job of its gate */
    j->store = 1;
    j->ids = taken;
    j->nids = missing;
    j->words = mwords;
    j->key_len = (uint8_t)q.key_bytes;
    j->local = local;
    j->nl = q.nl; /* every layer of the registration (a Put names none) */
    j->runs = runs;
    j->nruns = nr;
    j->ndev = missing * ps;
    j->bytes_per_layer = missing * ps * tb * g->parts;
    j->stream = kv_streams(0, j->bytes_per_layer * (int64_t)j->nl);
    j->host = c->arena;
    j->lp_stride = lp;
    j->stop = &never_stopped;
    j->deadline_ns = q.timeout_ms ? arrival + (int64_t)q.timeout_ms * 1000000 : 0;
    j->write_by_ns = write_by(l, i, j->deadline_ns);
    mark_writes(j, 1); /* a later Load into these device pages waits for this copy */
    enqueue(e, j);
    return 1;
}
