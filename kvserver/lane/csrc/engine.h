/* The Engine's Python methods: start and stop, its lanes, the slots and gates the loop hands back,
 * the hand-offs, the histograms and counters. A part of kvlane.c. */

static int engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"progress_interval", "buckets", "spin", NULL};
    double interval = 0.0, spin = 0.0;
    PyObject *buckets = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|dOd", names, &interval, &buckets, &spin))
        return -1;
    if (!(spin >= 0 && spin <= 0.01)) {
        PyErr_SetString(PyExc_ValueError, "spin must be between 0 and 10 ms");
        return -1;
    }
    if (buckets) {
        Py_ssize_t n = PySequence_Size(buckets);
        if (n < 0 || n > MAX_EDGES) {
            PyErr_SetString(PyExc_ValueError, "at most 32 bucket edges");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_GetItem(buckets, i);
            e->edges[i] = item ? PyFloat_AsDouble(item) : 0;
            Py_XDECREF(item);
            if (PyErr_Occurred())
                return -1;
        }
        e->nedges = (int)n;
    }
    if (e->started) {
        PyErr_SetString(PyExc_RuntimeError, "an Engine is made once");
        return -1;
    }
    e->progress_interval_ns = (int64_t)(interval * 1e9);
    e->spin_ns = (int64_t)(spin * 1e9);
    pthread_mutex_init(&e->call_mu, NULL);
    pthread_mutex_init(&e->lanes_mu, NULL);
    pthread_mutex_init(&e->cmd_mu, NULL);
    pthread_mutex_init(&e->hand_mu, NULL);
    pthread_mutex_init(&e->in_mu, NULL);
    pthread_mutex_init(&e->stat_mu, NULL);
    pthread_cond_init(&e->cmd_cv, NULL);
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    e->notify_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->epfd < 0 || e->wake_fd < 0 || e->notify_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(e->epfd, EPOLL_CTL_ADD, e->wake_fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        PyErr_SetString(PyExc_OSError, "could not start the data plane's thread");
        return -1;
    }
    e->started = 1;
    return 0;
}

static PyObject *engine_stop(Engine *e, PyObject *unused) {
    if (e->started == 1) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&e->call_mu);
        pthread_mutex_lock(&e->cmd_mu);
        e->cmd = CMD_STOP;
        pthread_mutex_unlock(&e->cmd_mu);
        wake(e->wake_fd);
        pthread_join(e->thread, NULL);
        /* Before call_mu goes: a command waiting for it (on DataPlane's command thread) then runs
         * nothing, and lets go of nothing of its lane: freed below with the others. */
        __atomic_store_n(&e->started, 2, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&e->call_mu);
        Py_END_ALLOW_THREADS
        while (e->lanes) { /* lanes never removed: their gate references go */
            Lane *l = e->lanes;
            e->lanes = l->next;
            Py_DECREF(l->gate);
            free(l);
        }
        while (e->fresh) { /* and those never given to the thread */
            Lane *l = e->fresh;
            e->fresh = l->fresh_next;
            Py_DECREF(l->gate);
            free(l);
        }
    }
    Py_RETURN_NONE;
}

static void engine_dealloc(Engine *e) {
    engine_stop(e, NULL);
    if (e->epfd > 0)
        close(e->epfd);
    if (e->wake_fd > 0)
        close(e->wake_fd);
    if (e->notify_fd > 0)
        close(e->notify_fd);
    free(e->hand);
    free(e->done);
    for (size_t k = 0; k < e->ngets; k++)
        free(e->gets[k].ids);
    free(e->gets);
    Py_XDECREF(e->cache);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* new_lane(key, gate, ring address, slots, submit fd, done fds, quiet=False) -> handle: a lane made,
 * not yet the thread's (watch_lane gives it): its handle is known before the thread can hand over
 * any request of it. quiet: the client sets a slot's waiting word before it sleeps on its done
 * doorbell (ring.FEATURE_QUIET_DONE). */
static PyObject *engine_new_lane(Engine *e, PyObject *args) {
    long long key;
    Gate *gate;
    unsigned long long ring;
    int slots, submit, quiet = 0;
    PyObject *done;
    if (!PyArg_ParseTuple(args, "LO!KiiO|p", &key, &GateType, &gate, &ring, &slots, &submit, &done, &quiet))
        return NULL;
    if (__atomic_load_n(&e->started, __ATOMIC_ACQUIRE) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    if (slots < 1 || slots > MAX_SLOTS || PySequence_Size(done) != slots) {
        PyErr_SetString(PyExc_ValueError, "a lane has 1 to 64 slots, one done doorbell each");
        return NULL;
    }
    Lane *l = calloc(1, sizeof(Lane));
    if (!l)
        return PyErr_NoMemory();
    for (int i = 0; i < slots; i++) {
        PyObject *item = PySequence_GetItem(done, i);
        l->done_fd[i] = item ? (int)PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (PyErr_Occurred()) {
            free(l);
            return NULL;
        }
    }
    PyObject *handle = PyLong_FromVoidPtr(l);
    if (!handle) {
        free(l);
        return NULL;
    }
    l->key = key;
    l->ring = (char *)(uintptr_t)ring;
    l->slots = slots;
    l->submit_fd = submit;
    l->quiet = quiet;
    l->gate = gate;
    Py_INCREF(gate);
    l->fresh_next = e->fresh;
    e->fresh = l;
    return handle;
}

/* watch_lane(handle): the thread watches a lane new_lane made; OSError where it cannot watch its
 * doorbell, RuntimeError once the plane has stopped: the lane is then freed (its handle names
 * nothing). Waits for the thread (the GIL released): the daemon calls it on its command thread. */
static PyObject *engine_watch_lane(Engine *e, PyObject *handle) {
    void *p = PyLong_AsVoidPtr(handle);
    if (!p && PyErr_Occurred())
        return NULL;
    Lane **pp = &e->fresh;
    while (*pp && *pp != p)
        pp = &(*pp)->fresh_next;
    if (!*pp) {
        PyErr_SetString(PyExc_KeyError, "no such new lane");
        return NULL;
    }
    Lane *l = *pp;
    *pp = l->fresh_next; /* the thread's, or freed, from here on */
    l->fresh_next = NULL;
    int err = 0;
    if (!run_command(e, CMD_ADD, l, &err)) { /* the plane stopped first: l was never its */
        Py_DECREF(l->gate);
        free(l);
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    if (err) { /* not among the thread's lanes: nothing of it is touched again */
        Py_DECREF(l->gate);
        free(l);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Among its lanes now, so a stop since (the GIL was another thread's meanwhile) has freed l,
     * or will once the GIL is its: l is not read again here. */
    if (__atomic_load_n(&e->started, __ATOMIC_ACQUIRE) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the data plane has stopped");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The lane of a handle, while it is among the thread's lanes. Its memory stays while the GIL is
 * held: only remove_lane and stop free a lane, each with the GIL. */
static Lane *lane_of(Engine *e, PyObject *handle) {
    void *p = PyLong_AsVoidPtr(handle);
    if (!p && PyErr_Occurred())
        return NULL;
    Lane *found = NULL;
    pthread_mutex_lock(&e->lanes_mu);
    for (Lane *l = e->lanes; l && !found; l = l->next)
        if (l == p)
            found = l;
    pthread_mutex_unlock(&e->lanes_mu);
    if (!found)
        PyErr_SetString(PyExc_KeyError, "no such lane");
    return found;
}

/* remove_lane(handle): once it returns, the thread touches nothing of the lane (its ring, its
 * doorbells); the caller may unmap and close them. Waits for the thread (the GIL released): the
 * daemon calls it on its command thread, not its event loop. */
static PyObject *engine_remove_lane(Engine *e, PyObject *handle) {
    Lane *l = lane_of(e, handle);
    if (!l)
        return NULL;
    if (!run_command(e, CMD_REMOVE, l, NULL))
        Py_RETURN_NONE; /* the plane stopped first: the stop let go of its lanes, this one too */
    Py_DECREF(l->gate);
    free(l);
    Py_RETURN_NONE;
}

/* finish_slot(handle, i, seq, code, response, message): the loop's answer of handed-off slot i, its
 * progress words already stored (Python writes those): the response and the message, each cut to
 * its room in the slot, the status, seq, the slot given back to the plane, DONE, then its doorbell,
 * rung on a quiet lane only for a client asleep on it (as the plane's own answers ring). */
static PyObject *engine_finish_slot(Engine *e, PyObject *args) {
    PyObject *handle;
    int i;
    unsigned long long seq;
    unsigned int code;
    Py_buffer resp, msg;
    if (!PyArg_ParseTuple(args, "OiKIy*y*", &handle, &i, &seq, &code, &resp, &msg))
        return NULL;
    PyObject *result = NULL;
    Lane *l = lane_of(e, handle);
    if (!l)
        goto done;
    if (i < 0 || i >= l->slots) {
        PyErr_SetString(PyExc_IndexError, "no such slot");
        goto done;
    }
    char *s = slot_at(l, i);
    uint32_t n = resp.len < RESPONSE_BYTES ? (uint32_t)resp.len : RESPONSE_BYTES;
    uint32_t m = msg.len < ERROR_BYTES ? (uint32_t)msg.len : ERROR_BYTES;
    memcpy(s + RESPONSE_AT, resp.buf, n);
    memcpy(s + ERROR_AT, msg.buf, m);
    put32(s + 20, code);
    put32(s + 24, n);
    put32(s + 28, m);
    uint64_t q = seq;
    memcpy(s + 64, &q, 8);
    __atomic_store_n(&l->slot_busy[i], 0, __ATOMIC_RELEASE);
    set_state(s, ST_DONE);
    ring_done(l, i);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&resp);
    PyBuffer_Release(&msg);
    return result;
}

static PyObject *engine_close_gate(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &GateType)) {
        PyErr_SetString(PyExc_TypeError, "a Gate");
        return NULL;
    }
    if (!run_command(e, CMD_CLOSE_GATE, arg, NULL))
        __atomic_store_n(&((Gate *)arg)->closed, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* pause(bool): tests hold the plane's copies (requests are still taken) and let them go. */
static PyObject *engine_pause(Engine *e, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    run_command(e, on ? CMD_PAUSE : CMD_RESUME, NULL, NULL);
    Py_RETURN_NONE;
}

static PyObject *engine_unwatch_all(Engine *e, PyObject *unused) {
    run_command(e, CMD_UNWATCH_ALL, NULL, NULL);
    Py_RETURN_NONE;
}

/* take_handoffs() -> [(lane key, slot, rpc, counted)], oldest first; drains the notify eventfd.
 * rpc: the call the plane read from the slot, the one the loop serves (the peer may have written
 * another there since); counted: the request is in its gate's py_inflight until Python's py_exit
 * for it. */
static PyObject *engine_take_handoffs(Engine *e, PyObject *unused) {
    uint64_t v;
    (void)!read(e->notify_fd, &v, 8);
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->nhand;
    pthread_mutex_unlock(&e->hand_mu);
    /* Built before the queue is emptied: out of memory, the handoffs stay for the next call. Only
     * the plane's thread adds to the queue, at its end, so the first n entries stay as they are. */
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (!out)
        return NULL;
    pthread_mutex_lock(&e->hand_mu);
    for (size_t k = 0; k < n; k++) {
        PyObject *item = Py_BuildValue("LiIO", (long long)e->hand[k].lane_key, e->hand[k].slot,
                                       (unsigned int)e->hand[k].rpc, e->hand[k].counted ? Py_True : Py_False);
        if (!item) {
            pthread_mutex_unlock(&e->hand_mu);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (n && e->nhand > n) /* never with a NULL queue: nothing was ever handed over */
        memmove(e->hand, e->hand + n, (e->nhand - n) * sizeof(Handoff));
    e->nhand -= n;
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}

/* take_histograms() -> [(counts per bucket, +Inf last), sum in seconds] for Write, Load, Load's
 * first layer, Get, Get's first layer and Lookup, zeroed: what the plane observed since the last
 * take. */
static PyObject *engine_take_histograms(Engine *e, PyObject *unused) {
    PyObject *out = PyList_New(H_KINDS);
    if (!out)
        return NULL;
    pthread_mutex_lock(&e->stat_mu);
    for (int h = 0; h < H_KINDS; h++) {
        PyObject *counts = PyList_New(e->nedges + 1);
        for (int b = 0; counts && b <= e->nedges; b++)
            PyList_SET_ITEM(counts, b, PyLong_FromUnsignedLongLong(e->hist[h][b]));
        PyList_SET_ITEM(out, h, counts ? Py_BuildValue("(Nd)", counts, e->hsum[h]) : NULL);
        memset(e->hist[h], 0, sizeof e->hist[h]);
        e->hsum[h] = 0;
    }
    pthread_mutex_unlock(&e->stat_mu);
    return out;
}

static PyObject *engine_get_notify_fd(Engine *e, void *unused) { return PyLong_FromLong(e->notify_fd); }
static PyObject *engine_get_jobs(Engine *e, void *unused) {
    return PyLong_FromLongLong(__atomic_load_n(&e->njobs, __ATOMIC_RELAXED));
}
static PyObject *engine_get_served(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->served, __ATOMIC_RELAXED));
}
static PyObject *engine_get_write_turns(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->write_turns, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_gets(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_gets, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_lookups(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_lookups, __ATOMIC_RELAXED));
}

static PyObject *engine_get_plane_space_lookups(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_space_lookups, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_puts(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_puts, __ATOMIC_RELAXED));
}
static PyObject *engine_get_plane_stores(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->plane_stores, __ATOMIC_RELAXED));
}
/* Ends of the calls served whole posted and not taken yet (take_gets). */
static PyObject *engine_get_ends_waiting(Engine *e, void *unused) {
    pthread_mutex_lock(&e->hand_mu);
    size_t n = e->ngets;
    pthread_mutex_unlock(&e->hand_mu);
    return PyLong_FromSize_t(n);
}

static PyObject *engine_get_command_cuts(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->cmd_cuts, __ATOMIC_RELAXED));
}

static PyObject *engine_get_command_delay_us(Engine *e, void *unused) {
    return PyLong_FromLongLong(__atomic_load_n(&e->cmd_delay_ns, __ATOMIC_RELAXED) / 1000);
}
static int engine_set_command_delay_us(Engine *e, PyObject *v, void *unused) {
    long long us = v ? PyLong_AsLongLong(v) : 0;
    if (us == -1 && PyErr_Occurred())
        return -1;
    if (us < 0 || us > 10000000) {
        PyErr_SetString(PyExc_ValueError, "0 to 10 s, in microseconds");
        return -1;
    }
    __atomic_store_n(&e->cmd_delay_ns, (int64_t)us * 1000, __ATOMIC_RELAXED);
    return 0;
}

static PyObject *engine_get_mutes(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->mutes, __ATOMIC_RELAXED));
}

static PyObject *engine_get_naps(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->naps, __ATOMIC_RELAXED));
}

static PyObject *engine_get_handed(Engine *e, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->handed, __ATOMIC_RELAXED));
}
