/* The loop's copies the plane runs (submit_copy): checked, planned into runs, queued, their ends
 * posted back (take_completions). A part of kvlane.c. */

/* An int64 array's buffer (writable if asked), at least `least` items, aligned; 0 on error (set). */
static int int64s(PyObject *obj, Py_buffer *v, int writable, Py_ssize_t least, const char *name) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (v->itemsize != 8 || (f[0] != 'l' && f[0] != 'q') || f[1] || (uintptr_t)v->buf % 8 || v->len / 8 < least) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s: not an aligned int64 array of %zd or more", name, least);
        return 0;
    }
    return 1;
}

/* Its request's count in the gate's py_inflight, given back once no byte of it is left to copy
 * and before its answer: the engine's next call, which may come as soon as it sees the answer, is
 * then the plane's. */
static void give_back(Job *j) {
    if (!j->counted)
        return;
    pthread_mutex_lock(&j->gate->mu);
    if (j->gate->py_inflight > 0)
        j->gate->py_inflight--;
    pthread_mutex_unlock(&j->gate->mu);
    j->counted = 0;
}

/* An answering copy run whole on the calling thread (submit_copy's now: a small Get while its gate
 * has no other copy, which the plane then starts none of: the request's count keeps them off),
 * answered as the plane answers it: its layers in order, then DONE (or NOT_FOUND for a client
 * released, DEADLINE_EXCEEDED past its timeout, decided before any byte moves). Returns the
 * status it answered. */
static uint32_t copy_now(Engine *e, Job *j) {
    Gate *g = j->gate;
    char msg[256];
    const char *reason = NULL;
    uint32_t code = 0;
    if (__atomic_load_n(j->stop, __ATOMIC_RELAXED)) {
        reason = "its client was unregistered or reclaimed";
        code = CODE_NOT_FOUND;
    } else if (j->deadline_ns && now_ns() >= j->deadline_ns) {
        reason = "its timeout_ms passed";
        code = CODE_DEADLINE;
    }
    if (reason) {
        snprintf(msg, sizeof msg,
                 "copy stopped because %s: 0 of its %u layers were copied, and nothing more of it will be",
                 reason, j->nl);
        give_back(j);
        answer_slot(e, j, code, msg);
        return code;
    }
    for (; j->li < j->nl; j->li++) {
        for (j->part = 0; j->part < g->parts; j->part++) {
            j->ri = 0;
            copy_runs(j, INT64_MAX);
        }
        j->part = 0;
        if (j->li == 0)
            observe(e, H_GET_FIRST, now_ns() - j->arrival_ns);
    }
    give_back(j);
    answer_slot(e, j, 0, NULL);
    return 0;
}

/* The runs of a copy's rows, counted (runs NULL) or written, in page order: page k's token t is
 * device token toks[k * ps + t] (paged: toks[k] * ps + t), its host row at offs[k] + t * tb; a
 * page's consecutive device tokens are one run. A paged copy is one run a page, planned without a
 * look at its tokens: the largest Put costs the loop a pass over its pages, not over its tokens. */
static int64_t plan_runs(Run *runs, const int64_t *offs, const int64_t *toks, int64_t npages, int64_t ps,
                         int64_t tb, int paged) {
    int64_t nr = 0;
    if (paged) {
        if (runs)
            for (int64_t k = 0; k < npages; k++)
                runs[k] = (Run){.host_off = offs[k], .dev_tok = toks[k] * ps, .ntok = ps};
        return npages;
    }
    for (int64_t k = 0; k < npages; k++) {
        const int64_t *row = toks + k * ps;
        for (int64_t t = 0; t < ps; t++) {
            if (t > 0 && row[t] == row[t - 1] + 1) {
                if (runs)
                    runs[nr - 1].ntok++;
                continue;
            }
            if (runs)
                runs[nr] = (Run){.host_off = offs[k] + t * tb, .dev_tok = row[t], .ntok = 1};
            nr++;
        }
    }
    return nr;
}

/* submit_copy(ticket, gate, load, host_base, lp_stride, host_limit, offsets, tokens, layers, stop,
 *             progress=None, signal_fd=-1, interval=0.0) -> bool
 * One of the loop's copies, run by this plane's thread among its own (the loop has ordered it
 * among the registration's copies and holds its turn: no job of the gate's lane runs meanwhile).
 * Host rows: page k's (layer, part) chunk at host_base + offsets[k] + (layer * parts + part) *
 * lp_stride, its tokens token_bytes apart; device rows: tokens[k * page_size + t] of the gate's
 * buffers; layers: the registration's local layer indices, copied in that order. Every offset's
 * chunks must lie inside [host_base, host_base + host_limit), every token and layer inside the
 * gate's, or nothing is submitted (ValueError). stop (int64[1]) is read at layer boundaries;
 * progress (int64[1], loads) is stored after each layer and signal_fd bumped at most once an
 * interval and at the end. Its end is posted back (take_completions) under ticket. False: the
 * gate is closed (nothing submitted). The arrays must outlive the copy: the caller keeps them
 * until its completion is taken.
 * paged=True: tokens holds one device page for every offset instead (its page_size tokens in
 * order), each inside the gate's whole pages.
 * now=False: an answering copy is copied and answered here, on the calling thread, before this
 * returns the status it answered (0 done; NOT_FOUND for a released client, DEADLINE_EXCEEDED past
 * its timeout: nothing copied), with nothing posted back (the caller ends it); -1 (nothing done)
 * unless its gate is open and has no copy in flight on the plane (its own or the loop's) and the
 * plane is not paused: the caller then submits it. For small copies, which cost less than a
 * wake-up of the plane's thread and of the loop for their end.
 * lane=None, slot=-1, found=0, timeout_ms=0, arrival_ns=0: with a lane (its handle, of this gate),
 * the copy is a load that answers `slot`, a request the lane handed over whose slot is still
 * busy, and runs after every earlier job of the gate: step 1 (no layer yet) is published there at once, then its layers and end as a plane
 * Load's are, `found` in the pages word,
 * the status and message of a stop too (its gate closed: NOT_FOUND; `timeout_ms` after
 * `arrival_ns`, CLOCK_MONOTONIC, else now: DEADLINE_EXCEEDED; its stop word, which only its
 * client's release sets: NOT_FOUND too); `counted`: the request holds one count of the gate's
 * py_inflight (a handed-over copy), which the plane gives back once the copy joins its jobs; and the
 * slot given back; its latencies go to the Get histograms.
 * write_by_ns=0: a write whose copy ends after it (CLOCK_MONOTONIC ns) is posted back DONE_LATE,
 * not done (Job.write_by_ns). */
static PyObject *engine_submit_copy(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"ticket", "gate", "load", "host_base", "lp_stride", "host_limit", "offsets",
                            "tokens", "layers", "stop", "progress", "signal_fd", "interval", "lane", "slot",
                            "found", "timeout_ms", "arrival_ns", "counted", "paged", "now", "write_by_ns", NULL};
    unsigned long long ticket, host_base;
    Gate *g;
    int load, signal_fd = -1, slot = -1, counted = 0, paged = 0, now = 0;
    long long lp_stride, host_limit, arrival = 0, write_by_ns = 0;
    unsigned int found = 0, timeout_ms = 0;
    PyObject *offsets_obj, *tokens_obj, *layers_obj, *stop_obj, *progress_obj = Py_None, *lane_obj = Py_None;
    double interval = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KO!pKLLOOOO|OidOiIILpppL", names, &ticket, &GateType, &g, &load,
                                     &host_base, &lp_stride, &host_limit, &offsets_obj, &tokens_obj,
                                     &layers_obj, &stop_obj, &progress_obj, &signal_fd, &interval, &lane_obj,
                                     &slot, &found, &timeout_ms, &arrival, &counted, &paged, &now,
                                     &write_by_ns))
        return NULL;
    if (e->started != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    if (g->space || __atomic_load_n(&g->cuda, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_ValueError, "a space's gate copies nothing, nor does a CUDA pool's for the loop");
        return NULL;
    }
    /* An answering copy: a load that answers slot `slot` of lane `lane` (handed over to the loop,
     * its slot still the plane's), which must be this gate's. */
    Lane *answer_lane = NULL;
    if (lane_obj != Py_None) {
        if (!(answer_lane = lane_of(e, lane_obj)))
            return NULL;
        if (!load || answer_lane->gate != g || slot < 0 || slot >= answer_lane->slots ||
            !__atomic_load_n(&answer_lane->slot_busy[slot], __ATOMIC_ACQUIRE)) {
            PyErr_SetString(PyExc_ValueError, "an answering copy is a load of a slot its gate's lane handed over");
            return NULL;
        }
    }
    Py_buffer off = {0}, tok = {0}, lay = {0}, stop = {0}, prog = {0};
    int have_off = 0, have_tok = 0, have_lay = 0, have_stop = 0, have_prog = 0;
    PyObject *result = NULL;
    Job *j = NULL;
    int64_t ps = g->lim.page_size, tb = g->token_bytes;
    if (!(have_off = int64s(offsets_obj, &off, 0, 0, "offsets")) ||
        !(have_tok = int64s(tokens_obj, &tok, 0, 0, "tokens")) ||
        !(have_lay = int64s(layers_obj, &lay, 0, 0, "layers")) ||
        !(have_stop = int64s(stop_obj, &stop, 0, 1, "stop")) ||
        (progress_obj != Py_None && !(have_prog = int64s(progress_obj, &prog, 1, 1, "progress"))))
        goto done;
    int64_t npages = off.len / 8, nl = lay.len / 8;
    const int64_t *offs = off.buf, *toks = tok.buf, *lays = lay.buf;
    int64_t chunks = (int64_t)g->lim.num_layers * g->parts;
    /* paged: tokens holds a device page for every offset, its page_size tokens in order. */
    if (tok.len / 8 != (paged ? npages : npages * ps)) {
        PyErr_SetString(PyExc_ValueError, paged ? "tokens must hold a device page for every offset"
                                                : "tokens must hold page_size tokens for every offset");
        goto done;
    }
    if (lp_stride < ps * tb || host_limit < 0 || lp_stride > host_limit || host_base + (unsigned long long)host_limit < host_base) {
        PyErr_SetString(PyExc_ValueError, "a host chunk must hold a page's tokens, inside the host span");
        goto done;
    }
    for (int64_t k = 0; k < npages; k++) /* every chunk of the page: offset + chunks * lp_stride <= limit */
        if (offs[k] < 0 || offs[k] > host_limit || (host_limit - offs[k]) / lp_stride < chunks) {
            PyErr_Format(PyExc_ValueError, "host offset %lld: its chunks are outside the host span", (long long)offs[k]);
            goto done;
        }
    for (int64_t k = 0; k < (paged ? npages : npages * ps); k++) /* a page: all of its tokens */
        if (toks[k] < 0 || (paged ? toks[k] >= g->lim.dev_tokens / ps : toks[k] >= g->lim.dev_tokens)) {
            PyErr_Format(PyExc_ValueError, "device %s %lld is outside the pool's %lld tokens",
                         paged ? "page" : "token", (long long)toks[k], (long long)g->lim.dev_tokens);
            goto done;
        }
    for (int64_t k = 0; k < nl; k++)
        if (lays[k] < 0 || lays[k] >= g->lim.num_layers) {
            PyErr_Format(PyExc_ValueError, "local layer %lld is outside the registration's %d", (long long)lays[k],
                         g->lim.num_layers);
            goto done;
        }
    j = calloc(1, sizeof(Job));
    if (j)
        j->local = malloc(sizeof(int32_t) * (size_t)(nl ? nl : 1));
    int64_t nr = plan_runs(NULL, offs, toks, npages, ps, tb, paged);
    if (j && j->local)
        j->runs = malloc(sizeof(Run) * (size_t)(nr ? nr : 1));
    if (!j || !j->local || !j->runs) {
        PyErr_NoMemory();
        goto done;
    }
    plan_runs(j->runs, offs, toks, npages, ps, tb, paged);
    for (int64_t k = 0; k < nl; k++)
        j->local[k] = (int32_t)lays[k];
    j->nruns = nr;
    j->nl = (uint32_t)nl;
    j->gate = g;
    j->load = load;
    j->ndev = npages * ps;
    j->bytes_per_layer = j->ndev * tb * g->parts;
    j->stream = kv_streams(j->load, j->bytes_per_layer * (int64_t)j->nl);
    j->host = (char *)(uintptr_t)host_base;
    j->lp_stride = lp_stride;
    j->ext = 1;
    j->ticket = ticket;
    j->progress = have_prog ? prog.buf : NULL;
    j->signal_fd = signal_fd;
    j->interval_ns = (int64_t)(interval * 1e9);
    j->stop = stop.buf;
    j->arrival_ns = arrival > 0 ? arrival : now_ns();
    j->write_by_ns = load || write_by_ns < 0 ? 0 : write_by_ns;
    if (answer_lane) {
        j->answers = 1;
        j->lane = answer_lane;
        j->slot = slot;
        j->found = found;
        j->counted = counted;
        j->deadline_ns = timeout_ms ? j->arrival_ns + (int64_t)timeout_ms * 1000000 : 0;
        /* Behind every earlier job of its gate (the plane's own may still run: the loop took it
         * with nothing else of the client in flight but those), as a Load touching their pages. */
        j->dependent = 1;
    }
    if (now) { /* copied here, now, or not at all (False: the caller submits it) */
        if (!j->answers) {
            PyErr_SetString(PyExc_ValueError, "only an answering copy is copied now");
            goto done;
        }
        pthread_mutex_lock(&g->mu);
        /* Its request's count (counted) is what keeps the plane from starting the gate's copies
         * meanwhile: without it, never copied here. */
        int idle = counted && g->py_inflight > 0 && !g->closed && !g->c_inflight && !g->x_inflight &&
                   !__atomic_load_n(&e->paused, __ATOMIC_RELAXED);
        if (idle)
            g->x_inflight++;
        pthread_mutex_unlock(&g->mu);
        uint32_t code = 0;
        if (idle) {
            code = copy_now(e, j);
            pthread_mutex_lock(&g->mu);
            g->x_inflight--;
            pthread_mutex_unlock(&g->mu);
        }
        result = PyLong_FromLong(idle ? (long)code : -1L);
        goto done;
    }
    /* room for its completion, kept until it is posted */
    if (!reserve_room(e, (void **)&e->done, &e->capdone, &e->ndone, &e->unposted, sizeof(Done))) {
        PyErr_NoMemory();
        goto done;
    }
    pthread_mutex_lock(&g->mu);
    int open = !g->closed;
    if (open)
        g->x_inflight++;
    pthread_mutex_unlock(&g->mu);
    if (!open) {
        pthread_mutex_lock(&e->hand_mu);
        e->unposted--;
        pthread_mutex_unlock(&e->hand_mu);
        result = Py_False;
        Py_INCREF(result);
        goto done;
    }
    if (j->answers) { /* step 1, the pages found, before any layer: the RPC's first message */
        publish_progress(e, j, 0);
        if (j->bytes_per_layer * (int64_t)j->nl > QUIET_FIRST_BYTES ||
            __atomic_load_n(&e->njobs, __ATOMIC_RELAXED) || __atomic_load_n(&e->paused, __ATOMIC_RELAXED))
            ring_step(j->lane, j->slot);
        else /* as if rung now: a sleeper's next ring is a progress interval away, or the end */
            j->last_pub_ns = now_ns();
    }
    __atomic_add_fetch(&e->njobs, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&e->in_mu);
    Job **tail = &e->incoming;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    __atomic_store_n(&e->nincoming, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->in_mu);
    j = NULL;
    wake(e->wake_fd);
    result = Py_True;
    Py_INCREF(result);
done:
    if (j)
        job_free(j);
    if (have_off)
        PyBuffer_Release(&off);
    if (have_tok)
        PyBuffer_Release(&tok);
    if (have_lay)
        PyBuffer_Release(&lay);
    if (have_stop)
        PyBuffer_Release(&stop);
    if (have_prog)
        PyBuffer_Release(&prog);
    return result;
}

/* take_completions() -> [(ticket, status, layers done)]: the loop's copies that ended, in the order
 * they ended; status 0 done, 1 stopped by its stop word, 2 its gate closed, 3 the plane stopped. */
static PyObject *engine_take_completions(Engine *e, PyObject *unused) {
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->ndone;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; out && k < n; k++) {
        PyObject *item = Py_BuildValue("KiI", (unsigned long long)e->done[k].ticket, e->done[k].status,
                                       e->done[k].layers);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (out)
        e->ndone = 0;
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}
