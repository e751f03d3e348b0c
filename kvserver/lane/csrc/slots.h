/* A lane's slots: taking what was submitted (lanes_turn, doorbell), the words a client reads (awake,
 * plane state, a load's progress), and a job's end and answer (finish, answer_slot). A part of
 * kvlane.c. */

/* Takes slot i of lane l if it is SUBMITTED (and not busy here): served on this thread, or handed
 * to the loop; one its client stopped waiting for before now (its expiry word) is answered
 * DEADLINE_EXCEEDED here, never started. 1 if it took it, *cost its share of the lane's credit
 * (lanes_turn). */
static int take_slot(Engine *e, Lane *l, int i, int64_t *cost) {
    if (__atomic_load_n(&l->slot_busy[i], __ATOMIC_ACQUIRE))
        return 0;
    char *s = slot_at(l, i);
    if (state_of(s) != ST_SUBMITTED)
        return 0;
    uint32_t rpc, n;
    uint64_t expires;
    memcpy(&rpc, s + 4, 4);
    memcpy(&n, s + 16, 4);
    memcpy(&expires, s + EXPIRES_AT, 8);
    set_state(s, ST_TAKEN);
    l->slot_busy[i] = 1;
    *cost = CALL_COST + (int64_t)n;
    if (expires && (uint64_t)now_ns() >= expires) {
        answer_error(l, i, CODE_DEADLINE,
                     "the call's client had stopped waiting for it when the daemon took it: not started");
        return 1;
    }
    if (l->gate->space) { /* a space's lane: its Lookups only; the loop refuses anything else */
        if (!(rpc == RPC_LOOKUP && try_answer(e, l, i, n)))
            handoff(e, l, i, rpc);
        return 1;
    }
    if (!try_job(e, l, i, rpc, n) && !(rpc == RPC_GET && try_get(e, l, i, n)) &&
        !(rpc == RPC_LOOKUP && try_answer(e, l, i, n)) && !(rpc == RPC_PUT && try_put(e, l, i, n)))
        handoff(e, l, i, rpc);
    return 1;
}

/* Takes lane l's next SUBMITTED slot, from its cursor on round its ring; 1 if it took one. */
static int take_next(Engine *e, Lane *l, int64_t *cost) {
    for (int k = 0; k < l->slots; k++) {
        int i = (l->cursor + k) % l->slots;
        if (take_slot(e, l, i, cost)) {
            l->cursor = (i + 1) % l->slots;
            return 1;
        }
    }
    return 0;
}

/* Lane l may have SUBMITTED slots (its doorbell rang, it was added, the thread looks at every
 * lane while it is awake): looked at in the turns to come, until one finds none. */
static void pend(Engine *e, Lane *l) {
    if (!l->pending) {
        l->pending = 1;
        e->npending++;
    }
}

static void unpend(Engine *e, Lane *l) {
    if (l->pending) {
        l->pending = 0;
        e->npending--;
    }
}

/* One turn of the pending lanes, each given LANE_QUANTUM more credit (up to LANE_QUANTUM) and,
 * while it has any, its next SUBMITTED slot taken, for that call's cost (its request's bytes and
 * CALL_COST): deficit round robin, in request bytes. A lane with nothing submitted is pending no
 * longer; one owing credit stays pending until it is served. The thread reads its doorbells and
 * runs a piece of the copies between two turns. So a lane of small calls (a Load or Get of a few pages: tens of bytes) is served every
 * turn, and one of large calls (a Lookup of 1024 keys: 16 KiB) one turn in sixteen: a peer that
 * keeps every slot of many lanes full of those delays another lane's call by about one of its
 * calls, not one of each lane, nor all of their slots; alone, it is served at once (a turn that
 * took nothing for want of credit gives every pending lane the turns' credit it lacked at once).
 * A turn starts at the lane after where the last one started, and a waiting command cuts it at
 * the next lane once it has taken a slot, the next turn starting there: no lane waits on the
 * others' order, nor on commands in a row. Returns how many it took. */
static int lanes_turn(Engine *e) {
    Lane *start = e->turn_at ? e->turn_at : e->lanes, *l = start;
    int took = 0, owing = 0;
    int64_t best = INT64_MIN, cost = 0;
    if (!start || !e->npending)
        return 0;
    do {
        if (l->pending) {
            if (took && cmd_waiting(e)) { /* the loop waits for its command: the rest after it (a turn
                                             * takes one slot first, so commands in a row stall none) */
                e->turn_at = l;
                __atomic_add_fetch(&e->cmd_cuts, 1, __ATOMIC_RELAXED);
                return took;
            }
            l->credit = l->credit > 0 ? LANE_QUANTUM : l->credit + LANE_QUANTUM;
            if (l->credit <= 0) {
                owing = 1;
                best = l->credit > best ? l->credit : best;
            } else if (take_next(e, l, &cost)) {
                l->credit -= cost;
                l->idle_rings = 0;
                took++;
            } else {
                unpend(e, l);
            }
        }
        l = l->next ? l->next : e->lanes;
    } while (l != start);
    e->turn_at = start->next;
    if (!took && owing) { /* the turns it would take any of them to be served, given at once */
        int64_t turns = -best / LANE_QUANTUM;
        for (l = e->lanes; l; l = l->next)
            if (l->pending && l->credit <= 0)
                l->credit += turns * LANE_QUANTUM;
    }
    return took;
}

/* Every watched lane pending, rung or not (the thread is awake: clients do not ring), then a turn. */
static int look_at_all(Engine *e) {
    for (Lane *l = e->lanes; l; l = l->next)
        if (l->watching)
            pend(e, l);
    return lanes_turn(e);
}

/* Tells every lane's clients whether this thread looks at their slots without being rung. */
static void set_awake(Engine *e, int awake) {
    for (Lane *l = e->lanes; l; l = l->next)
        __atomic_store_n((uint32_t *)(l->ring + AWAKE_AT), (uint32_t)awake, __ATOMIC_RELAXED);
    e->awake = awake;
}

/* The plane words of the watched lanes (asleep or running: PLANE_*), on a change. */
static void set_plane(Engine *e, uint32_t state) {
    if (e->plane_state == state)
        return;
    for (Lane *l = e->lanes; l; l = l->next)
        if (l->watching)
            __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), state, __ATOMIC_RELAXED);
    e->plane_state = state;
}

static void unwatch(Engine *e, Lane *l) {
    if (!l->watching)
        return;
    epoll_ctl(e->epfd, EPOLL_CTL_DEL, l->submit_fd, NULL);
    l->watching = 0;
    if (l->muted_until) {
        l->muted_until = 0;
        e->nmuted--;
    }
    __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), 0u, __ATOMIC_RELAXED); /* a nudge reaches no one */
    e->watched_slots -= l->slots;
}

/* A rung doorbell (``events``: epoll's for its socket). The peer's leaving is told by the socket
 * (EPOLLRDHUP, EPOLLHUP), never by an empty read: a SOCK_SEQPACKET message may be empty, and read
 * as an end of file it would leave the lane unwatched, its calls never taken. The messages carry
 * nothing: up to MAX_DRAIN of them are read in one call, so a peer ringing without end costs this
 * thread one call a turn, not one a message. */
static void gone(Engine *e, Lane *l) {
    unwatch(e, l);
    if (l->gate->space) /* no release closes a space's lane: the loop is told (slot -1) */
        handoff(e, l, -1, 0);
}

static void doorbell(Engine *e, Lane *l, uint32_t events) {
    if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) { /* gone; its release cleans up */
        gone(e, l);
    } else {
        char buf[MAX_DRAIN];
        struct iovec iov[MAX_DRAIN];
        struct mmsghdr msgs[MAX_DRAIN];
        memset(msgs, 0, sizeof msgs);
        for (int k = 0; k < MAX_DRAIN; k++) {
            iov[k].iov_base = buf + k;
            iov[k].iov_len = 1;
            msgs[k].msg_hdr.msg_iov = iov + k;
            msgs[k].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(l->submit_fd, msgs, MAX_DRAIN, MSG_DONTWAIT, NULL);
        if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            /* A doorbell that reads as rung but cannot be read (checked at the opening to be one
             * end of a connected pair: defence in depth) is not watched again: no spinning. */
            gone(e, l);
            pend(e, l);
            return;
        }
        if (got > 0 && (l->idle_rings += got) > MAX_IDLE_RINGS && !l->muted_until) {
            /* Rings without calls: muted a while (the peer's leaving still seen), then looked at. */
            struct epoll_event ev = {.events = EPOLLRDHUP, .data.ptr = l};
            if (epoll_ctl(e->epfd, EPOLL_CTL_MOD, l->submit_fd, &ev) == 0) {
                l->muted_until = now_ns() + MUTE_NS;
                e->nmuted++;
                __atomic_add_fetch(&e->mutes, 1, __ATOMIC_RELAXED);
            }
        }
    }
    pend(e, l);
}

/* Watches again the doorbells muted until now or before, their lanes looked at (a call rung while
 * muted is found so); returns the milliseconds until the next one is due (-1: none muted). */
static int unmute_due(Engine *e) {
    if (!e->nmuted)
        return -1;
    int64_t now = now_ns(), next = INT64_MAX;
    for (Lane *l = e->lanes; l; l = l->next) {
        if (!l->muted_until)
            continue;
        if (l->muted_until > now) {
            next = l->muted_until < next ? l->muted_until : next;
            continue;
        }
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = l};
        if (epoll_ctl(e->epfd, EPOLL_CTL_MOD, l->submit_fd, &ev) == 0 || !l->watching) {
            l->muted_until = 0;
            l->idle_rings = 0;
            e->nmuted--;
            pend(e, l);
        }
    }
    return next == INT64_MAX ? -1 : (int)((next - now + 999999) / 1000000);
}

static void publish_progress(Engine *e, Job *j, uint32_t flags) {
    char *s = slot_at(j->lane, j->slot);
    Gate *g = j->gate;
    uint32_t last = (uint32_t)(g->lim.start_layer + (j->li ? j->local[j->li - 1] : 0));
    j->step++;
    put32(s + 32, j->li);
    put32(s + 36, j->li ? last : 0);
    put64(s + 40, (uint64_t)j->li * (uint64_t)j->bytes_per_layer);
    put32(s + 48, j->recorded);
    put32(s + 52, j->found);
    put32(s + 60, flags);
    /* The layer's bytes and the words above before the step a reader watches (x86 keeps store
     * order anyway; a weakly ordered CPU needs the fence, and the reader an acquire: docs/lane.md). */
    __atomic_store_n((uint32_t *)(s + 56), j->step, __ATOMIC_RELEASE);
    j->published = j->li;
}

/* An ext load's layer landed: its progress word, then its eventfd (at most once an interval, and
 * always for the last layer), as the copy kernel signals a LayerSignal. */
static void ext_layer(Job *j) {
    if (!j->progress)
        return;
    __atomic_store_n(j->progress, (int64_t)j->li, __ATOMIC_RELEASE);
    int64_t t = now_ns();
    if (j->signal_fd >= 0 && (j->li == j->nl || t - j->last_pub_ns >= j->interval_ns)) {
        j->last_pub_ns = t;
        wake(j->signal_fd);
    }
}

static void unlink_job(Engine *e, Job *j) {
    Job **pp = &e->jobs;
    while (*pp != j)
        pp = &(*pp)->next;
    *pp = j->next;
    __atomic_sub_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
    job_free(j);
}

/* Ends one of the loop's copies: posted back with how it ended and how many layers landed. */
static void finish_ext(Engine *e, Job *j, int status) {
    Gate *g = j->gate;
    pthread_mutex_lock(&g->mu);
    g->x_inflight--;
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_lock(&e->hand_mu);
    e->done[e->ndone].ticket = j->ticket; /* room kept at submit_copy */
    e->done[e->ndone].status = status;
    e->done[e->ndone].layers = j->li;
    e->ndone++;
    e->unposted--;
    pthread_mutex_unlock(&e->hand_mu);
    unlink_job(e, j);
    wake(e->notify_fd);
}

static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message);

/* Ends a Put the plane stores (try_put). Copied (code 0): under the cache's lock, each key filed
 * under the part in the stash page it was copied into (cache_store), unless the part holds it by
 * now (counted present: another Put stored it meanwhile, or it came twice); its end posted with the
 * pages filed first and the others after (the loop settles the ones, gives the others back to the
 * stash), then its slot answered. The lock the loop's for longer than the plane waits, the cache
 * closed, or one of its keys being written by another Put by now (the loop's, which waits for that
 * copy, and stores the key itself if it fails: a Put says present only of what is or will be
 * stored): nothing filed, and the slot handed to the loop, which serves the Put anew. Stopped (a
 * deadline, its gate closed) or its lane gone: nothing filed, its end posted, its slot answered
 * with why (unless its lane is gone). */
static void finish_put(Engine *e, Job *j, uint32_t code, const char *message, int answer) {
    Gate *g = j->gate;
    Cache *c = e->cache;
    int64_t stored = 0, present = j->misses, dropped = 0, filed = 0;
    mark_writes(j, -1);
    if (code == 0 && answer && cache_try_lock(c)) {
        filed = c->open;
        for (int64_t k = 0; filed && k < j->nids; k++) { /* a key being written: all of it the loop's */
            int64_t f = kv_index_find_one(&c->ix, j->words + KV_KEY_WORDS * k, j->key_len, g->cache_gid);
            filed = f < 0 || (f < c->pg.npages && c->pg.state[f] == KV_COMMITTED);
        }
        for (int64_t k = 0; filed && k < j->nids; k++) {
            int got = cache_store(c, j->ids[k], j->words + KV_KEY_WORDS * k, j->key_len, g->cache_gid);
            if (got <= 0) {
                *(got == 0 ? &present : &dropped) += 1;
                continue;
            }
            int64_t id = j->ids[stored]; /* the filed first: ids[0..stored) */
            j->ids[stored++] = j->ids[k];
            j->ids[k] = id;
        }
        pthread_mutex_unlock(&c->mu);
    }
    int handed = !filed && code == 0 && answer;
    j->found = (uint32_t)stored;
    j->misses = handed ? 0 : present; /* counted present by its end, unless the loop serves it anew */
    j->bytes_per_layer = stored * g->lim.page_size * g->token_bytes * g->parts;
    Lane *l = j->lane;
    int slot = j->slot;
    int64_t arrival = j->arrival_ns;
    post_get_end(e, j, filed ? DONE_OK : j->released ? DONE_RELEASED : DONE_HALTED);
    if (filed) {
        unsigned char resp[48];
        uint32_t len = put_response(resp, stored, present, dropped, (int64_t)j->nl * j->bytes_per_layer);
        observe(e, H_PUT, now_ns() - arrival);
        __atomic_add_fetch(&e->plane_stores, 1, __ATOMIC_RELAXED);
        answer_unary(e, l, slot, resp, len, arrival);
    } else if (handed) {
        handoff(e, l, slot, RPC_PUT);
    } else if (answer) {
        answer_slot(e, j, code, message);
    }
    unlink_job(e, j);
}

static void cuda_forget(Engine *e, Job *j);

/* Ends a job: its pages are no longer busy, its slot answered (unless its lane is gone: silent).
 * A write whose copy ended past its write_by_ns is not done: ended as stopped by its deadline. */
static void finish(Engine *e, Job *j, uint32_t code, const char *message, int answer) {
    cuda_forget(e, j);
    int late = code == 0 && !j->load && j->write_by_ns && now_ns() > j->write_by_ns;
    if (late) {
        code = CODE_DEADLINE;
        message = LATE_WRITE;
    }
    if (j->store) {
        finish_put(e, j, code, message, answer);
        return;
    }
    if (j->get) { /* a Get served here: its end posted back with its pages, then its slot answered
                   * (a Stats after the answer settles it: its counters are there) */
        post_get_end(e, j, code == 0 ? DONE_OK : j->released ? DONE_RELEASED : DONE_HALTED);
        if (answer)
            answer_slot(e, j, code, message);
        unlink_job(e, j);
        return;
    }
    if (j->ext && !j->answers) {
        finish_ext(e, j, code == 0 ? DONE_OK : late ? DONE_LATE : DONE_HALTED);
        return;
    }
    Gate *g = j->gate;
    int ok = code == 0;
    if (j->ext) { /* an answering copy of the loop's: its slot, then its end posted back */
        if (answer)
            answer_slot(e, j, code, message);
        finish_ext(e, j, ok ? DONE_OK : (j->released ? DONE_RELEASED : DONE_HALTED));
        return;
    }
    if (!j->load && !j->cuda)
        mark_writes(j, -1);
    pthread_mutex_lock(&g->mu);
    for (int64_t k = 0; k < j->npages; k++)
        g->busy[j->pages[k]]--;
    g->c_inflight--;
    if (ok && answer) {
        if (j->load) {
            g->bytes_loaded += (uint64_t)j->nl * (uint64_t)j->bytes_per_layer;
            g->load_ops++;
        } else {
            g->bytes_written += (uint64_t)j->nl * (uint64_t)j->bytes_per_layer;
            g->write_ops++;
        }
        g->served++;
    }
    pthread_mutex_unlock(&g->mu);
    if (answer)
        answer_slot(e, j, code, message);
    unlink_job(e, j);
}

/* Answers a job's slot: a load's layers and DONE, or its status and message. */
static void answer_slot(Engine *e, Job *j, uint32_t code, const char *message) {
    int ok = code == 0;
    int64_t took = now_ns() - j->arrival_ns;
    observe(e, j->answers ? H_GET : j->store ? H_PUT : j->load ? H_LOAD : H_WRITE, took);
    Lane *l = j->lane;
    char *s = slot_at(l, j->slot);
    /* This thread's time on the call, from taking the request to this answer (its turns behind
     * other copies included), without either side's wake-ups: what the client expects its next
     * Write to take (docs/lane.md, "Napping through a long write"). At least 1: 0 says "not the
     * plane's". */
    int64_t us = took / 1000;
    put32(s + BUSY_AT, us < 1 ? 1u : us > (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)us);
    uint32_t resp_len = 0, msg_len = 0;
    if (ok && j->load) {
        publish_progress(e, j, FLAG_DONE | FLAG_JOB_ENDED);
    } else {
        if (!ok && j->load && j->li > j->published)
            publish_progress(e, j, 0); /* the layers that landed, then why it stopped */
        put32(s + 60, FLAG_JOB_ENDED);
    }
    if (j->get) { /* said in its flags, which the client reads once it sees DONE */
        uint32_t flags;
        memcpy(&flags, s + 60, 4);
        put32(s + 60, flags | FLAG_PLANE_GET);
    }
    if (ok && !j->load) /* WriteResponse{bytes}: field 1 */
        resp_len = pb_varint_field((unsigned char *)s + RESPONSE_AT, 0x08,
                                   (uint64_t)j->nl * (uint64_t)j->bytes_per_layer);
    if (message) {
        msg_len = (uint32_t)strlen(message);
        if (msg_len > ERROR_BYTES)
            msg_len = ERROR_BYTES;
        memcpy(s + ERROR_AT, message, msg_len);
    }
    put32(s + 20, code);
    put32(s + 24, resp_len);
    put32(s + 28, msg_len);
    memcpy(s + 64, s + 8, 8); /* done_seq: the seq the client wrote (TAKEN: it is ours) */
    __atomic_store_n(&l->slot_busy[j->slot], 0, __ATOMIC_RELEASE);
    __atomic_add_fetch(&e->served, 1, __ATOMIC_RELAXED); /* counted before the client can see it */
    set_state(s, ST_DONE);
    ring_done(l, j->slot);
}

static void stop_job(Engine *e, Job *j, const char *reason, uint32_t code, int answer) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "copy stopped because %s: %u of its %u layers were copied, and nothing more of it will be",
             reason, j->li, j->nl);
    finish(e, j, code, msg, answer);
}
