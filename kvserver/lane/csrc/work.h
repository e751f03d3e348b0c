/* The order of a registration's copies and the copying itself: which job may run (mark_runnable),
 * its pieces (run_piece), one pass over the jobs (work). A part of kvlane.c. */

/* mark_runnable's passes, counted across engines: a gate's marks are never read for another pass's.
 * (A gate belongs to one engine, whose thread alone reads and writes them; two engines' threads on
 * one gate would race, as on its write marks.) */
static uint64_t order_passes;

/* A registration's own copies keep their order: a job may run only if no earlier job of its gate
 * holds it back, that is any earlier one for a job that depends on its writes (every write, and a
 * load touching their pages), else an earlier load. One pass in arrival order marks every job, so
 * a piece costs O(jobs), not a scan of the earlier jobs for each one (O(jobs^2) with many engines'
 * rings full). */
static void mark_runnable(Engine *e) {
    uint64_t pass = __atomic_add_fetch(&order_passes, 1, __ATOMIC_RELAXED);
    for (Job *j = e->jobs; j; j = j->next) {
        Gate *g = j->gate;
        if (g->order_pass != pass) {
            g->order_pass = pass;
            g->order_any = g->order_loads = 0;
        }
        /* A CUDA job is on its stream from the start (cuda_issue): the stream keeps its order. */
        j->can_run = !j->cuda && !(j->dependent ? g->order_any : g->order_loads);
        g->order_any = 1;
        if (j->load)
            g->order_loads = 1;
    }
}

/* Copies job j's runs of its current (layer, part) from run j->ri on, until `budget` bytes are
 * copied or none is left, and fences them (before any progress, end or answer can say the bytes
 * are there); returns the bytes copied. */
static int64_t copy_runs(Job *j, int64_t budget) {
    Gate *g = j->gate;
    int64_t lp = (int64_t)j->local[j->li] * g->parts + j->part;
    char *host = j->host + lp * j->lp_stride;
    char *dev = g->dev_bases[lp];
    int64_t left = budget, tb = g->token_bytes, stride = g->dev_stride;
    while (j->ri < j->nruns && left > 0) {
        Run *r = &j->runs[j->ri++];
        size_t nb = (size_t)(r->ntok * tb);
        char *h = host + r->host_off, *d = dev + r->dev_tok * stride;
        if (stride == tb) {
            if (j->load)
                kv_copy(d, h, nb, j->stream);
            else
                kv_copy(h, d, nb, j->stream);
        } else { /* a pool with room between its tokens: the run's tokens one by one */
            for (int64_t t = 0; t < r->ntok; t++, h += tb, d += stride)
                if (j->load)
                    kv_copy(d, h, (size_t)tb, j->stream);
                else
                    kv_copy(h, d, (size_t)tb, j->stream);
        }
        left -= (int64_t)nb;
    }
    kv_copy_fence(j->stream);
    return budget - left;
}

static int64_t run_piece(Engine *e, Job *j) {
    Gate *g = j->gate;
    int64_t copied = copy_runs(j, PIECE_BYTES);
    if (j->ri < j->nruns)
        return copied;
    j->ri = 0;
    if (++j->part < g->parts)
        return copied;
    j->part = 0;
    j->li++;
    if (j->ext && !j->answers) {
        ext_layer(j);
        if (j->li == j->nl)
            finish(e, j, 0, NULL, 1);
        return copied;
    }
    if (j->load && j->li == 1)
        observe(e, j->answers ? H_GET_FIRST : H_FIRST, now_ns() - j->arrival_ns);
    if (j->li == j->nl) {
        finish(e, j, 0, NULL, 1);
        return copied;
    }
    if (j->load) {
        /* Every layer's words (a few stores: a spinning waiter sees each layer land); the
         * doorbell that wakes a sleeping waiter at most once per progress interval (each costs
         * this thread a system call and the engine a wake-up), and always at the end. */
        publish_progress(e, j, 0);
        int64_t t = now_ns();
        if (t - j->last_pub_ns >= e->progress_interval_ns) {
            j->last_pub_ns = t;
            ring_step(j->lane, j->slot);
        }
    }
    return copied;
}

/* Stops jobs whose deadline passed, at a layer boundary; runs one piece of the best job.
 * Returns whether any job is left. */
static int work(Engine *e) {
    int64_t t = 0;
    for (Job *j = e->jobs, *next; j; j = next) {
        next = j->next;
        if (j->cuda) { /* on the GPU already: it ends once the GPU is done with it, or is given up on */
            if (j->released && j->cu_stalled) {
                stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, !j->cu_quiet);
            } else {
                if (!t)
                    t = now_ns();
                cuda_poll(e, j, t);
            }
            continue;
        }
        if (j->part || j->ri)
            continue; /* a layer is never left half copied */
        if (j->answers) { /* its gate's close may have come before the job joined: read it here */
            /* Its stop word is set only by its client's release (no call waits on it to cancel). */
            if (j->released || __atomic_load_n(&j->gate->closed, __ATOMIC_ACQUIRE) ||
                __atomic_load_n(j->stop, __ATOMIC_RELAXED)) {
                j->released = 1;
                stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, 1);
            } else if (j->li == j->nl) {
                finish(e, j, 0, NULL, 1);
            } else if (j->deadline_ns) {
                if (!t)
                    t = now_ns();
                if (t >= j->deadline_ns)
                    stop_job(e, j, "its timeout_ms passed", CODE_DEADLINE, 1);
            }
            continue;
        }
        if (j->ext) { /* its gate's close may have come before the job joined: read it here */
            if (j->released || __atomic_load_n(&j->gate->closed, __ATOMIC_ACQUIRE))
                finish_ext(e, j, DONE_RELEASED);
            else if (__atomic_load_n(j->stop, __ATOMIC_RELAXED))
                finish_ext(e, j, DONE_STOPPED);
            else if (j->li == j->nl) /* no layers asked for */
                finish_ext(e, j, DONE_OK);
            continue;
        }
        if (j->released) {
            stop_job(e, j, "its client was unregistered or reclaimed", CODE_NOT_FOUND, 1);
        } else if (j->deadline_ns) {
            if (!t)
                t = now_ns();
            if (t >= j->deadline_ns)
                stop_job(e, j, "its timeout_ms passed", CODE_DEADLINE, 1);
        }
    }
    Job *best = NULL;
    if (e->paused)
        return e->jobs != NULL;
    mark_runnable(e); /* after the stops above, which may have ended jobs */
    /* A job to stop (released, past its deadline) finishes its layer first, whatever else waits:
     * a release or a deadline is never held up by other engines' loads. */
    for (Job *j = e->jobs; j && !best; j = j->next)
        if ((j->released || (j->deadline_ns && (t ? t : (t = now_ns())) >= j->deadline_ns) ||
             (j->ext && __atomic_load_n(j->stop, __ATOMIC_RELAXED))) && j->can_run)
            best = j;
    /* Loads first, but not for ever: after WRITE_EVERY_BYTES of loads in a row while a write
     * waited, writes get WRITE_TURN_BYTES (as the copy workers give a write a 2 MiB piece after
     * eight of loads), so a stream of loads never starves an offload, however many layers it has. */
    int write_turn = e->write_credit > 0;
    for (Job *j = e->jobs; j && !best && !write_turn; j = j->next)
        if (j->load && j->can_run)
            best = j;
    /* Writes take turns, a piece each, in arrival order from the one after the write that last
     * copied (the list is in arrival order): a large offload or Put of one engine never holds
     * another engine's write until it ends. A registration's own copies keep their order
     * (mark_runnable()). */
    Job *first = NULL;
    for (Job *j = e->jobs; j && !best; j = j->next)
        if (!j->load && j->can_run) {
            if (!first)
                first = j;
            if (j->seq > e->last_write)
                best = j;
        }
    if (!best)
        best = first;
    for (Job *j = e->jobs; j && !best; j = j->next) /* a write's turn, and no write to take */
        if (j->load && j->can_run)
            best = j;
    if (!best)
        return e->jobs != NULL;
    int load = best->load, writes_wait = 0, loads_wait = 0; /* runnable, besides best */
    for (Job *j = e->jobs; j && !(load ? writes_wait : loads_wait); j = j->next)
        if (j != best && j->load != load && j->can_run)
            *(j->load ? &loads_wait : &writes_wait) = 1;
    if (!load) {
        e->last_write = best->seq;
        if (write_turn && loads_wait) /* a piece run ahead of a load: counted for the tests */
            __atomic_add_fetch(&e->write_turns, 1, __ATOMIC_RELAXED);
    }
    int64_t copied = run_piece(e, best); /* best may be gone after it */
    if (load && writes_wait) {
        e->loads_in_a_row += copied;
        if (e->loads_in_a_row >= WRITE_EVERY_BYTES) {
            e->loads_in_a_row = 0;
            e->write_credit = WRITE_TURN_BYTES;
        }
    } else if (!load && loads_wait && write_turn) {
        e->write_credit -= copied; /* the writes' turn, spent piece by piece */
    } else { /* nothing waited on the other side: nothing is owed either way */
        e->loads_in_a_row = 0;
        e->write_credit = 0;
    }
    return e->jobs != NULL;
}
