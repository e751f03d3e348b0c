/* A CUDA pool's gate: the driver's entry points, the pool's stream and events, the copy kernel and
 * the engines' ready events the loop hands the plane (set_cuda, set_cuda_kernels, add_ready). A part
 * of kvlane.c. */

/* The n addresses of sequence `seq` into out[]; -1 (set) if one is not an int, or, where `what`
 * names them, is 0 (NULL). */
static int addresses(PyObject *seq, void **out, Py_ssize_t n, const char *what) {
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_GetItem(seq, k);
        if (!item)
            return -1;
        out[k] = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred())
            return -1;
        if (what && !out[k]) {
            PyErr_Format(PyExc_ValueError, "%s is NULL", what);
            return -1;
        }
    }
    return 0;
}

#define CU_MAX_READY 16 /* engines' ready events a gate knows: more go to the loop, which opens them */
/* Driver calls the plane may have on all gates' streams for jobs not ended (each gate at most its
 * set_cuda max_queued): past it, jobs are the loop's, whose copy workers may wait in the driver. */
#define CU_PLANE_QUEUED_MAX 16384

/* set_cuda(driver, ctx, stream, events, slots, host_shift, wait_seconds, max_copies, min_copy_bytes,
 * small_copies, max_queued): this gate's pool is a CUDA pool's, once, before its lane is added: its copies are
 * the GPU's, put on `stream` (a CUstream of context `ctx`) through `driver` (the addresses of the
 * KV_CU_ENTRY_POINTS entry points, in kv_cuda_driver's order), a load recording its layers' events
 * (`events`, slots * num_layers CUevents, slot-major), a write one of its own. `host_shift` turns a
 * host address of the region into the GPU's; no progress for `wait_seconds` gives the pool's GPU
 * work up (cuda_failed). A job of more than `max_copies` cuMemcpyAsync, or of more than
 * `small_copies` with one of fewer than `min_copy_bytes` bytes, is the copy kernel's (the loop's
 * unless set_cuda_kernels); one that would put more than `max_queued` driver calls on the stream
 * for jobs not ended is the loop's. Loads may then name event slots below `slots`, and requests carry a ready
 * event (64 bytes) the plane waits on if the loop gave it that event (add_ready). */
static PyObject *gate_set_cuda(Gate *g, PyObject *args) {
    PyObject *driver, *events;
    unsigned long long ctx, stream;
    int slots;
    long long shift, max_copies, min_copy_bytes, small_copies, max_queued;
    double wait;
    if (!PyArg_ParseTuple(args, "OKKOiLdLLLL", &driver, &ctx, &stream, &events, &slots, &shift, &wait,
                          &max_copies, &min_copy_bytes, &small_copies, &max_queued))
        return NULL;
    if (g->space || !g->owned_obj || g->cuda || g->cache_gid >= 0 || g->capstash) {
        PyErr_SetString(PyExc_RuntimeError, "set_cuda is for a new pool's gate, once, before any cache use");
        return NULL;
    }
    if (slots <= 0 || !(wait > 0) || max_copies <= 0 || min_copy_bytes < 0 || small_copies < 0 ||
        max_queued <= 0) {
        PyErr_SetString(PyExc_ValueError, "set_cuda's slots, wait and copy limits must be positive");
        return NULL;
    }
    if (PySequence_Size(driver) != KV_CU_ENTRY_POINTS) {
        PyErr_SetString(PyExc_ValueError, "the driver table has one address per entry point");
        return NULL;
    }
    Py_ssize_t ne = PySequence_Size(events);
    if (ne != (Py_ssize_t)slots * g->lim.num_layers) {
        PyErr_SetString(PyExc_ValueError, "events must hold slots * num_layers events");
        return NULL;
    }
    void *fn[KV_CU_ENTRY_POINTS];
    if (addresses(driver, fn, KV_CU_ENTRY_POINTS, "a driver entry point") < 0)
        return NULL;
    void **ev = calloc((size_t)ne, sizeof(void *));
    unsigned char(*ready)[64] = calloc(CU_MAX_READY, 64);
    void **ready_ev = calloc(CU_MAX_READY, sizeof(void *));
    if (!ev || !ready || !ready_ev) {
        free(ev);
        free(ready);
        free(ready_ev);
        return PyErr_NoMemory();
    }
    if (addresses(events, ev, ne, NULL) < 0) {
        free(ev);
        free(ready);
        free(ready_ev);
        return NULL;
    }
    memcpy(&g->cu, fn, sizeof fn); /* kv_cuda_driver is KV_CU_ENTRY_POINTS pointers, in this order */
    g->cu_ctx = (void *)(uintptr_t)ctx;
    g->cu_stream = (void *)(uintptr_t)stream;
    g->cu_events = ev;
    g->cu_ready = ready;
    g->cu_ready_ev = ready_ev;
    g->cu_host_shift = shift;
    g->cu_wait_ns = (int64_t)(wait * 1e9);
    g->cu_max_copies = max_copies;
    g->cu_min_copy_bytes = min_copy_bytes;
    g->cu_small_copies = small_copies;
    g->cu_max_queued = max_queued;
    pthread_mutex_lock(&g->check_mu);
    g->lim.max_event_slot = (uint32_t)slots - 1;
    g->lim.ready_len = 64;
    pthread_mutex_unlock(&g->check_mu);
    __atomic_store_n(&g->cuda, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* set_cuda_kernels(functions, args_host, args_bytes, args_shift, max_blocks, warps): a CUDA gate's
 * jobs of many small rows (past set_cuda's copy limits) are the copy kernel's launches from now on
 * (once, after set_cuda and before its lane is added): `functions`, the kernel's CUfunction for a
 * word of 8, 4, 2 and 1 bytes (media/cuda/kernels.py, loaded for the pool's device); `args_host`,
 * `args_bytes` bytes of pinned host memory mapped for the device (`args_shift` added to a host
 * address of it gives the device's), where a job's bases and offsets go; grids of at most
 * `max_blocks` blocks of `warps` warps. */
static PyObject *gate_set_cuda_kernels(Gate *g, PyObject *args) {
    PyObject *functions;
    unsigned long long host;
    long long nbytes, shift;
    int max_blocks, warps;
    if (!PyArg_ParseTuple(args, "OKLLii", &functions, &host, &nbytes, &shift, &max_blocks, &warps))
        return NULL;
    if (!g->cuda || g->cu_kernels[0]) {
        PyErr_SetString(PyExc_RuntimeError, "set_cuda_kernels is for a CUDA gate, once");
        return NULL;
    }
    if (!host || host % 16 || nbytes < 4096 || nbytes % 16 || max_blocks <= 0 || warps <= 0 || warps > 32 ||
        PySequence_Size(functions) != 4) {
        PyErr_SetString(PyExc_ValueError, "set_cuda_kernels takes 4 functions, an aligned area of 4 KiB "
                        "or more in 16-byte steps, and a positive grid");
        return NULL;
    }
    void *fn[4];
    if (addresses(functions, fn, 4, "a kernel function") < 0)
        return NULL;
    g->cu_args = (char *)(uintptr_t)host;
    g->cu_args_bytes = nbytes;
    g->cu_args_shift = shift;
    g->cu_max_blocks = max_blocks;
    g->cu_warps = warps;
    memcpy(g->cu_kernels, fn, sizeof fn); /* last: cuda_takes looks at cu_kernels[0] */
    Py_RETURN_NONE;
}

/* add_ready(handle, event) -> bool: the plane may wait on `event` (a CUevent the loop opened from
 * the engine's IPC `handle`, 64 bytes) for requests naming that handle; False if the gate knows
 * CU_MAX_READY already (those requests stay the loop's). The event must live until the gate is
 * closed and idle: the loop keeps every event it gave here open until the pool's release. */
static PyObject *gate_add_ready(Gate *g, PyObject *args) {
    Py_buffer handle;
    unsigned long long event;
    if (!PyArg_ParseTuple(args, "y*K", &handle, &event))
        return NULL;
    int added = 0, ok = g->cuda && handle.len == 64 && event;
    if (ok) {
        pthread_mutex_lock(&g->mu);
        int known = 0;
        for (int k = 0; k < g->cu_nready && !known; k++)
            known = memcmp(g->cu_ready[k], handle.buf, 64) == 0;
        if (!known && g->cu_nready < CU_MAX_READY) {
            memcpy(g->cu_ready[g->cu_nready], handle.buf, 64);
            g->cu_ready_ev[g->cu_nready++] = (void *)(uintptr_t)event;
            added = 1;
        }
        pthread_mutex_unlock(&g->mu);
    }
    PyBuffer_Release(&handle);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "add_ready is for a CUDA gate: a 64-byte handle and its event");
        return NULL;
    }
    return PyBool_FromLong(added);
}

static PyObject *gate_get_cuda(Gate *g, void *unused) { return PyBool_FromLong(__atomic_load_n(&g->cuda, __ATOMIC_ACQUIRE)); }

static PyObject *gate_get_cuda_failed(Gate *g, void *unused) {
    pthread_mutex_lock(&g->mu);
    char why[sizeof g->cu_failed];
    memcpy(why, g->cu_failed, sizeof why);
    pthread_mutex_unlock(&g->mu);
    if (!why[0])
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(why, (Py_ssize_t)strnlen(why, sizeof why), "replace");
}

static PyObject *gate_get_cuda_jobs(Gate *g, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&g->cu_jobs, __ATOMIC_RELAXED));
}

static PyObject *gate_get_cuda_kernel_jobs(Gate *g, void *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&g->cu_kernel_jobs, __ATOMIC_RELAXED));
}
