/* The plane's thread: the loop's commands (add or remove a lane, close a gate, pause, stop), what
 * the loop submitted, and engine_main's wait, spin and nap. A part of kvlane.c. */

static void remove_lane(Engine *e, Lane *l) {
    for (Job *j = e->jobs, *next; j; j = next) {
        next = j->next;
        if (j->lane == l && j->cuda) {
            /* On the GPU: it keeps its pages until its events pass or it is given up on, released
             * or not; its ring is not written again. Its gate outlives it: the client holds the
             * gate (ClientState.gate) until its release has seen the gate idle (DataPlane.idle). */
            j->cu_quiet = 1;
            j->lane = NULL;
        }
        else if (j->lane == l)
            finish(e, j, 1, NULL, 0); /* its ring goes now: nothing is written to it */
    }
    unwatch(e, l);
    unpend(e, l);
    if (e->turn_at == l) /* the next turn: from the next lane on */
        e->turn_at = l->next;
    pthread_mutex_lock(&e->lanes_mu);
    Lane **pp = &e->lanes;
    while (*pp && *pp != l)
        pp = &(*pp)->next;
    if (*pp)
        *pp = l->next;
    pthread_mutex_unlock(&e->lanes_mu);
}

static void take_incoming(Engine *e);

static void command(Engine *e) {
    int64_t delay = __atomic_load_n(&e->cmd_delay_ns, __ATOMIC_RELAXED);
    if (delay > 0 && __atomic_load_n(&e->cmd_waiting, __ATOMIC_ACQUIRE)) {
        struct timespec ts = {.tv_sec = delay / 1000000000LL, .tv_nsec = delay % 1000000000LL};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&e->cmd_mu);
    int cmd = e->cmd;
    void *arg = e->cmd_arg;
    /* Taken: the turn after it is not cut for it (the next one waits for call_mu until this one is
     * done). */
    __atomic_store_n(&e->cmd_waiting, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->cmd_mu);
    if (cmd == CMD_NONE)
        return;
    int done_errno = 0;
    if (cmd == CMD_ADD) {
        Lane *l = arg;
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = l};
        if (e->drained) { /* an opening that waited behind the stop's unwatch_all: not watched */
            done_errno = ESHUTDOWN;
        } else if (epoll_ctl(e->epfd, EPOLL_CTL_ADD, l->submit_fd, &ev) < 0) {
            /* Never rung, it would be served only while the thread spins: not taken at all, and
             * watch_lane refuses it (its calls go over gRPC). */
            done_errno = errno ? errno : EIO;
        } else {
            l->watching = 1;
            e->watched_slots += l->slots;
            /* The client may ring ahead of a call (a nudge), so that this thread is awake when the
             * request lands: a wake-up it would otherwise wait for after writing it. */
            __atomic_store_n((uint32_t *)(l->ring + PLANE_AT), e->plane_state ? e->plane_state : PLANE_RUNNING,
                             __ATOMIC_RELAXED);
            pthread_mutex_lock(&e->lanes_mu);
            l->next = e->lanes;
            e->lanes = l;
            pthread_mutex_unlock(&e->lanes_mu);
            __atomic_store_n((uint32_t *)(l->ring + AWAKE_AT), (uint32_t)e->awake, __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            pend(e, l); /* its slots submitted before it was watched: the next turn's */
        }
    } else if (cmd == CMD_REMOVE) {
        take_incoming(e); /* an answering copy submitted for this lane is ended with it */
        remove_lane(e, arg);
    } else if (cmd == CMD_CLOSE_GATE) {
        Gate *g = arg;
        pthread_mutex_lock(&g->mu);
        __atomic_store_n(&g->closed, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&g->mu);
        for (Job *j = e->jobs; j; j = j->next)
            if (j->gate == g)
                j->released = 1; /* ends at its next layer boundary: Python waits for inflight 0 */
    } else if (cmd == CMD_PAUSE || cmd == CMD_RESUME) {
        e->paused = cmd == CMD_PAUSE;
    } else if (cmd == CMD_UNWATCH_ALL) { /* nothing more taken: pending lanes too, nor new lanes */
        e->drained = 1;
        for (Lane *l = e->lanes; l; l = l->next) {
            unwatch(e, l);
            unpend(e, l);
        }
        e->turn_at = NULL;
    }
    pthread_mutex_lock(&e->cmd_mu);
    e->cmd = CMD_NONE;
    e->cmd_errno = done_errno;
    e->cmd_done = 1;
    pthread_cond_broadcast(&e->cmd_cv);
    pthread_mutex_unlock(&e->cmd_mu);
}

/* The loop's copies submitted since the last look join the jobs, in submission order. */
static void take_incoming(Engine *e) {
    if (!__atomic_load_n(&e->nincoming, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&e->in_mu);
    Job *in = e->incoming;
    e->incoming = NULL;
    __atomic_store_n(&e->nincoming, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->in_mu);
    Job **tail = &e->jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = in;
    for (; in; in = in->next) {
        in->seq = ++e->next_seq;
        if (in->counted) {
            /* An answering copy's request was counted in its gate's py_inflight when it was handed
             * over, which keeps the gate's new requests off the plane. Given back here, on this
             * thread, once the copy is among the jobs: a request taken after this runs behind it
             * (mark_runnable), so the plane takes them again without waiting for the loop to
             * settle the copy's end. */
            pthread_mutex_lock(&in->gate->mu);
            if (in->gate->py_inflight > 0)
                in->gate->py_inflight--;
            pthread_mutex_unlock(&in->gate->mu);
            in->counted = 0;
        }
    }
}

static void *engine_main(void *arg) {
    Engine *e = arg;
    struct epoll_event evs[64];
    /* Until then, an idle thread looks again at once instead of sleeping: an engine's next call
     * usually follows its last answer within microseconds, and waking a sleeping thread costs
     * more than that (tens of microseconds on a virtual machine). */
    int64_t spin_until = 0;
    for (;;) {
        /* Held (tests), jobs still meet their deadlines: looked at every millisecond. Lanes still
         * pending (a turn took a slot of theirs, or was cut for a command): their next turn at
         * once, but for a thread awake, which looks at every lane as it spins anyway. */
        int timeout = e->jobs || (e->npending && !e->awake) ? (e->paused && !e->npending ? 1 : 0) : -1;
        int spinning = timeout < 0 && spin_until && now_ns() < spin_until;
        /* While the thread spins it says so in every ring, and clients skip the doorbell: it
         * finds their slots by looking. Before it sleeps or copies (between pieces it reads the
         * doorbells: one system call, however many lanes) it takes that back, then looks once
         * more: a client that read "awake" just before stored its slot's state first, and a full
         * fence on each side makes one of the two see the other. */
        int looking = spinning && e->watched_slots <= AWAKE_MAX_SLOTS;
        if (looking != e->awake) {
            set_awake(e, looking);
            if (!looking) {
                __atomic_thread_fence(__ATOMIC_SEQ_CST);
                if (look_at_all(e)) {
                    if (e->spin_ns)
                        spin_until = now_ns() + e->spin_ns;
                    continue;
                }
            }
        }
        if (!looking && e->npending) /* (awake no longer, or never: the turn without a wait) */
            timeout = 0;
        /* Before a sleep (not a look, nor a held copy's 1 ms wait) the lanes' plane words say
         * so, and a client rings ahead of its next call (docs/lane.md, "Ringing ahead"). */
        int sleeps = !spinning && timeout < 0 && !cmd_waiting(e);
        if (sleeps)
            set_plane(e, PLANE_ASLEEP);
        /* Only CUDA jobs, waiting on the GPU, and no lane pending: a nap (finer than epoll's
         * milliseconds), woken early by a doorbell or a command, before their events are looked
         * at again. A pending lane's turn is not put off: its client rang already (or never will:
         * the thread was awake), and no doorbell would end the nap for it. */
        int64_t nap = timeout == 0 && !e->npending ? cuda_nap_ns(e) : 0;
        if (nap > 0) {
            __atomic_add_fetch(&e->naps, 1, __ATOMIC_RELAXED);
            struct pollfd p = {.fd = e->epfd, .events = POLLIN};
            struct timespec ts = {.tv_sec = nap / 1000000000LL, .tv_nsec = nap % 1000000000LL};
            (void)ppoll(&p, 1, &ts, NULL);
        }
        int wait = spinning ? 0 : timeout;
        int unmute = unmute_due(e); /* a muted doorbell is watched again once due: no wait outlasts it */
        if (unmute >= 0 && (wait < 0 || unmute < wait))
            wait = unmute;
        int n = epoll_wait(e->epfd, evs, 64, wait);
        if (sleeps)
            set_plane(e, PLANE_RUNNING);
        int took = looking ? look_at_all(e) : 0;
        if (spinning && n == 0 && !took) {
            sched_yield();  /* a spinning thread lets whatever else is runnable on its CPU go first */
            continue;
        }
        int stop = 0, woken = 0;
        /* Lanes first: a command may remove (and its caller free) a lane of this same batch. */
        for (int k = 0; k < n; k++) {
            if (evs[k].data.ptr == NULL) {
                woken = 1;
            } else {
                Lane *l = evs[k].data.ptr;
                if (l->watching && !cmd_waiting(e)) /* (else left readable: the next wait's) */
                    doorbell(e, l, evs[k].events);
            }
        }
        if (woken) {
            uint64_t v;
            (void)!read(e->wake_fd, &v, 8);
            pthread_mutex_lock(&e->cmd_mu);
            stop = e->cmd == CMD_STOP;
            pthread_mutex_unlock(&e->cmd_mu);
            if (!stop)
                command(e);
        }
        if (!stop && !cmd_waiting(e)) {
            if (!looking || n > 0) /* (looking, the turn was look_at_all's: one turn a piece) */
                took += lanes_turn(e);
        } else if (!woken && cmd_waiting(e)) {
            sched_yield(); /* its wake-up is on its way: the caller runs first */
        }
        if ((n > 0 || took || e->jobs) && e->spin_ns)
            spin_until = now_ns() + e->spin_ns;
        take_incoming(e);
        if (stop)
            break;
        if (e->jobs)
            work(e);
    }
    take_incoming(e);
    while (e->jobs)
        finish(e, e->jobs, 1, NULL, 0);
    /* Stopped: no ring says this thread looks at its slots or reads its doorbell any more. */
    set_awake(e, 0);
    for (Lane *l = e->lanes; l; l = l->next)
        unwatch(e, l);
    return NULL;
}

/* Runs a command on the thread and waits for it (the GIL released meanwhile). Returns 0, having
 * run nothing, once the thread has stopped (or never started); else 1, and the command's errno in
 * *err if given (an add's: 0, the lane is watched). */
static int run_command(Engine *e, int cmd, void *arg, int *err) {
    int ran = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->call_mu);
    if (__atomic_load_n(&e->started, __ATOMIC_ACQUIRE) != 1) {
        pthread_mutex_unlock(&e->call_mu);
        goto out;
    }
    ran = 1;
    pthread_mutex_lock(&e->cmd_mu);
    e->cmd = cmd;
    e->cmd_arg = arg;
    e->cmd_done = 0;
    __atomic_store_n(&e->cmd_waiting, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->cmd_mu);
    wake(e->wake_fd);
    pthread_mutex_lock(&e->cmd_mu);
    while (!e->cmd_done)
        pthread_cond_wait(&e->cmd_cv, &e->cmd_mu);
    if (err)
        *err = e->cmd_errno;
    pthread_mutex_unlock(&e->cmd_mu);
    pthread_mutex_unlock(&e->call_mu);
out:
    Py_END_ALLOW_THREADS
    return ran;
}
