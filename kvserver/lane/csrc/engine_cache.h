/* The node-wide cache on the plane: the cache it walks (set_cache), the pages set aside for its Puts
 * (stash, unstash), and the ends of the Gets, Lookups and Puts it served (take_gets). A part of
 * kvlane.c. */

/* set_cache(cache): the node-wide cache whose Gets this plane may serve whole, for the gates given a
 * part (Gate.set_cache). Once, before any gate is. */
static PyObject *engine_set_cache(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &CacheType)) {
        PyErr_SetString(PyExc_TypeError, "a Cache");
        return NULL;
    }
    if (e->cache) {
        PyErr_SetString(PyExc_RuntimeError, "the plane's cache is set once");
        return NULL;
    }
    Py_INCREF(arg);
    __atomic_store_n(&e->cache, (Cache *)arg, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* stash(gate, ids, full): free cache pages (int64 ids) the loop set aside for the gate's Puts
 * (try_put): each being written, in no part, of the gate's tenant, inside the tables; appended to
 * its stash, which the loop keeps at `full` pages (a Put of at most that many that finds it short
 * says so: stash_short, cleared here once it holds that many; ids may be empty, to say `full`).
 * With the cache's lock held, on a gate given its part (set_cache), not closed. */
static PyObject *engine_stash(Engine *e, PyObject *args) {
    PyObject *go;
    Py_buffer v;
    long long full;
    if (!PyArg_ParseTuple(args, "O!y*L", &GateType, &go, &v, &full))
        return NULL;
    Gate *g = (Gate *)go;
    Cache *c = e->cache;
    PyObject *r = NULL;
    if (!c || !c->open) {
        PyErr_SetString(PyExc_RuntimeError, "the plane serves no cache");
        goto done;
    }
    if (!cache_held(c))
        goto done;
    if (v.len % 8 || g->space || __atomic_load_n(&g->cache_gid, __ATOMIC_ACQUIRE) < 0 ||
        __atomic_load_n(&g->closed, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_ValueError, "int64 page ids, for an open gate given its part");
        goto done;
    }
    const int64_t *ids = v.buf;
    int64_t n = v.len / 8;
    for (int64_t k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= c->pg.npages || c->pg.state[ids[k]] != 2 || c->part[ids[k]] != -1) {
            PyErr_SetString(PyExc_ValueError, "a stash takes pages being written and in no part");
            goto done;
        }
    /* No page twice (two keys would be filed in it): against the stash and one another, sorted
     * (the loop's own bookkeeping keeps a page out of two gates' stashes). */
    int64_t m = g->nstash + n;
    int64_t *all = malloc(sizeof(int64_t) * (size_t)(m ? m : 1));
    if (!all) {
        PyErr_NoMemory();
        goto done;
    }
    if (g->nstash) /* (a stash never given a page has no array yet) */
        memcpy(all, g->stash, sizeof(int64_t) * (size_t)g->nstash);
    if (n)
        memcpy(all + g->nstash, ids, sizeof(int64_t) * (size_t)n);
    qsort(all, (size_t)m, sizeof(int64_t), cmp_i64);
    int twice = 0;
    for (int64_t k = 1; k < m && !twice; k++)
        twice = all[k] == all[k - 1];
    free(all);
    if (twice) {
        PyErr_SetString(PyExc_ValueError, "a page is set aside once");
        goto done;
    }
    if (g->nstash + n > g->capstash) {
        int64_t cap = 2 * (g->nstash + n) + 16;
        int64_t *more = realloc(g->stash, sizeof(int64_t) * (size_t)cap);
        if (!more) {
            PyErr_NoMemory();
            goto done;
        }
        g->stash = more;
        g->capstash = cap;
    }
    if (n) {
        memcpy(g->stash + g->nstash, ids, sizeof(int64_t) * (size_t)n);
        g->nstash += n;
    }
    g->stash_full = full > 0 ? full : 0;
    if (g->nstash >= g->stash_full) /* (a return of a few pages leaves a short stash short) */
        g->stash_short = 0;
    r = Py_None;
    Py_INCREF(r);
done:
    PyBuffer_Release(&v);
    return r;
}

/* unstash(gate) -> bytes: the gate's stash (int64 ids), emptied. With the cache's lock held. */
static PyObject *engine_unstash(Engine *e, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &GateType)) {
        PyErr_SetString(PyExc_TypeError, "a Gate");
        return NULL;
    }
    Gate *g = (Gate *)arg;
    if (!e->cache) {
        PyErr_SetString(PyExc_RuntimeError, "the plane serves no cache");
        return NULL;
    }
    if (!cache_held(e->cache))
        return NULL;
    PyObject *r = PyBytes_FromStringAndSize((const char *)g->stash, (Py_ssize_t)(8 * g->nstash));
    if (r)
        g->nstash = 0;
    return r;
}

/* take_gets(most=-1, most_ids=-1) -> [(token, gid, ids, found, misses, status, layers, bytes,
 * kind)]: the Gets (and Lookups, and Puts of keys all stored) served whole on the plane that
 * ended, in the order they ended: the oldest `most` of them, carrying at most `most_ids` page ids
 * in all, the first taken whatever it carries (-1: no bound). Those left are the next call's, and
 * post no wake-up until every one is taken. Each: the gate's token and cache part, the page ids
 * found (int64 bytes: a Get's are held, which the loop lets go), the pages found and the keys
 * missed, status 0 done, 2 its gate closed, 3 stopped otherwise (a deadline, the plane stopped,
 * handed to the loop after all), the layers copied and the bytes (done only), kind 0 a Get, 1 a
 * Lookup, 2 a Put, 3 a Lookup of host memory only (memory_only), 4 a Put that stored pages
 * (END_STORE: its first `found` ids filed and held, the rest its stash's pages back, `misses` its
 * keys present). */
static PyObject *engine_take_gets(Engine *e, PyObject *args) {
    Py_ssize_t most = -1, most_ids = -1;
    if (!PyArg_ParseTuple(args, "|nn", &most, &most_ids))
        return NULL;
    pthread_mutex_lock(&e->hand_mu);
    size_t n = most >= 0 && (size_t)most < e->ngets ? (size_t)most : e->ngets;
    if (most_ids >= 0) {
        int64_t ids = 0;
        for (size_t k = 0; k < n; k++) {
            ids += e->gets[k].ids ? e->gets[k].nids : 0;
            if (k && ids > most_ids) {
                n = k;
                break;
            }
        }
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; out && k < n; k++) {
        GetEnd *d = &e->gets[k];
        PyObject *item = Py_BuildValue("Liy#LLiILi", (long long)d->token, d->gid, (const char *)d->ids,
                                       (Py_ssize_t)(d->ids ? 8 * d->nids : 0), (long long)d->found,
                                       (long long)d->misses, d->status, d->layers, (long long)d->nbytes,
                                       d->kind);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, item);
    }
    if (out) {
        for (size_t k = 0; k < n; k++)
            free(e->gets[k].ids);
        if (n < e->ngets) /* (room kept for unposted ends stays past them: reserve_room counts it) */
            memmove(e->gets, e->gets + n, (e->ngets - n) * sizeof(GetEnd));
        e->ngets -= n;
    }
    pthread_mutex_unlock(&e->hand_mu);
    return out;
}
