/* The engine's side of the lane in compiled code (kvserver.protocol._wire): packing a binary Write
 * or Load (request.h's format) and submitting it to a slot, so that a lane call costs the engine's
 * scheduler a few microseconds of its CPU instead of a few dozen Python and numpy calls. The
 * Python in kvserver/protocol/lane_request.py and client/_transport/lane.py does the same where
 * this is not built.
 *
 * pack(kind, host_addr, host_n, dev_addr, dev_n, layers, page_size, timeout_ms, event_slot, ready)
 *   -> bytes, or None when the host indices are not whole pages of page_size in order. host_addr
 *   and dev_addr are the addresses of the caller's own contiguous int64 arrays (it keeps them alive
 *   for the call); layers is a sequence of ints.
 * submit(ring_addr, slot, rpc, seq, data, fd[, expires]): writes data into the slot's request area,
 *   its rpc, seq, length and expiry (ring.py: EXPIRES_AT; 0, the default: none), clears its progress words, marks it
 *   SUBMITTED (release order) and rings fd, unless the ring's awake word says the daemon's data
 *   plane looks at the slots unrung.
 * nudge(ring_addr, fd) -> whether it rang: rings fd (the submit doorbell) if the ring's plane word
 *   says the daemon's data plane reads that doorbell and sleeps, so that it wakes while the caller
 *   builds its request (docs/lane.md, "Ringing ahead").
 * wait(ring_addr, slot, fd, step, spin, deadline[, nap]) -> 0 (ready), 1 (fd's end of file: the
 *   daemon closed its end, or this client shut it), 2 (deadline passed). Ready: the slot is DONE
 *   or, with step >= 0, its step word is not step. With the GIL released, it sleeps on fd until
 *   nap (a time on time.monotonic()'s clock; 0: no nap) unless rung or ready first, then looks at
 *   the slot's words for up to spin seconds (yielding the CPU between looks; not while the crowded
 *   window below runs, and no longer once another thread had the CPU meanwhile), then polls fd, the
 *   slot's done doorbell, until deadline, draining it on each wake; the slot's waiting word says
 *   it sleeps meanwhile (a quiet ring's daemon rings only then). A signal runs its Python
 *   handler; an exception there is raised.
 * word(ring_addr, slot, offset): one 32-bit word of the slot's header, read with an acquire load.
 * progress(ring_addr, slot) -> (state, layers_done, last_layer, bytes, events_recorded, pages,
 *   step, flags): state and step read with acquire loads, before the words they publish.
 * result(ring_addr, slot) -> (code, response, message, flags) of a DONE slot, lengths bounded by
 *   the areas they lie in (the daemon's numbers are not trusted to stay inside the slot).
 * call(ring_addr, slot, rpc, seq, data, submit_fd, done_fd, spin, deadline, nap[, expires]) -> a unary call
 *   whole: submit(), wait() on done_fd (step -1; nap 0: none), then (code, response, message,
 *   flags, busy, slept) if the slot is DONE, busy being the data plane's microseconds on it (0: not
 *   the plane's) and slept 1 if the caller was asleep when the answer came (found on waking from
 *   the doorbell or the nap's timer, not while looking), else wait()'s 1 or 2. One call, so that a
 *   Write or Lookup on a cold cache runs a few Python frames fewer on the engine's thread.
 * crowded([window]) -> (window, left, noticed): the crowded window, in which this process's waits
 *   do not spin (below, "Spins that find the CPU shared").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include "../../lane/csrc/request.h"
#include "sources.h"

#define HEADER_BYTES 64
#define SLOT_BYTES (128 + 64 * 1024 + 1024 + 3 * 1024)
#define REQUEST_AT 128
#define REQUEST_BYTES (64 * 1024)
#define RESPONSE_AT (REQUEST_AT + REQUEST_BYTES)
#define RESPONSE_BYTES 1024
#define ERROR_AT (RESPONSE_AT + RESPONSE_BYTES)
#define ERROR_BYTES (3 * 1024)
#define ST_DONE 3u
#define STEP_AT 56
#define WAITING_AT 72 /* slot header: the client sleeps on the done doorbell */
#define AWAKE_AT 32   /* ring header: the daemon looks at the slots unrung */
#define PLANE_AT 36   /* ring header: the daemon's data plane reads the submit doorbell: */
#define PLANE_ASLEEP 1 /* ... and sleeps (2: it runs) */
#define BUSY_AT 80    /* slot header: the data plane's time on the call (microseconds) */
#define EXPIRES_AT 88 /* slot header: when the client stops waiting (the daemon's CLOCK_MONOTONIC, ns) */

static char *slot_at(unsigned long long ring, int slot) {
    return (char *)(uintptr_t)ring + HEADER_BYTES + (size_t)slot * SLOT_BYTES;
}

/* Whether slot is not one of the ring's (its header's slot count: the caller's own ring). */
static int bad_slot(unsigned long long ring, int slot) {
    uint32_t slots;
    memcpy(&slots, (const char *)(uintptr_t)ring + 8, 4);
    if (slot >= 0 && slot < 64 && (uint32_t)slot < slots)
        return 0;
    PyErr_SetString(PyExc_ValueError, "no such slot");
    return 1;
}

static inline uint32_t acquire32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }

static inline uint32_t get32(const char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    unsigned int kind, timeout_ms, event_slot;
    unsigned long long host_addr, dev_addr;
    Py_ssize_t host_n, dev_n, ps;
    PyObject *layers;
    Py_buffer ready;
    if (!PyArg_ParseTuple(args, "IKnKnOnIIy*", &kind, &host_addr, &host_n, &dev_addr, &dev_n, &layers, &ps,
                          &timeout_ms, &event_slot, &ready))
        return NULL;
    PyObject *out = NULL;
    PyObject *seq = PySequence_Fast(layers, "layers must be a sequence");
    if (!seq)
        goto done;
    Py_ssize_t nl = PySequence_Fast_GET_SIZE(seq);
    const int64_t *host = (const int64_t *)(uintptr_t)host_addr, *dev = (const int64_t *)(uintptr_t)dev_addr;
    if (ps <= 0 || host_n <= 0 || host_n % ps || host_n / ps > UINT32_MAX || dev_n > UINT32_MAX || nl > UINT32_MAX) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    Py_ssize_t np_ = host_n / ps;
    for (Py_ssize_t k = 0; k < np_; k++) {
        int64_t h = host[k * ps];
        if ((h & KV_SLOT_MASK) % ps) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        for (Py_ssize_t j = 1; j < ps; j++)
            if ((uint64_t)host[k * ps + j] != (uint64_t)h + (uint64_t)j) {
                out = Py_None;
                Py_INCREF(out);
                goto done;
            }
    }
    int runs = dev_n == host_n;
    for (Py_ssize_t k = 0; runs && k < np_; k++)
        for (Py_ssize_t j = 1; runs && j < ps; j++)
            runs = (uint64_t)dev[k * ps + j] == (uint64_t)dev[k * ps] + (uint64_t)j;
    Py_ssize_t nd = runs ? np_ : dev_n;
    Py_ssize_t len = KV_REQ_HEADER + 8 * np_ + 8 * nd + 4 * nl + ready.len;
    out = PyBytes_FromStringAndSize(NULL, len);
    if (!out)
        goto done;
    char *p = PyBytes_AS_STRING(out);
    uint32_t hdr[10] = {KV_REQ_MAGIC, KV_REQ_VERSION | (kind << 16), runs ? KV_DEV_RUNS : 0, (uint32_t)np_,
                        (uint32_t)nd, (uint32_t)nl, timeout_ms, event_slot, (uint32_t)ready.len, 0};
    memcpy(p, hdr, sizeof hdr);
    p += KV_REQ_HEADER;
    for (Py_ssize_t k = 0; k < np_; k++, p += 8)
        memcpy(p, &host[k * ps], 8);
    if (runs) {
        for (Py_ssize_t k = 0; k < np_; k++, p += 8)
            memcpy(p, &dev[k * ps], 8);
    } else {
        memcpy(p, dev, 8 * (size_t)dev_n);
        p += 8 * dev_n;
    }
    for (Py_ssize_t i = 0; i < nl; i++, p += 4) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v < 0 || v > UINT32_MAX) { /* not a layer id this format carries: the protobuf request does */
            Py_CLEAR(out);
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError))
                goto done;
            PyErr_Clear();
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        uint32_t u = (uint32_t)v;
        memcpy(p, &u, 4);
    }
    memcpy(p, ready.buf, (size_t)ready.len);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&ready);
    return out;
}

/* Writes data (at most REQUEST_BYTES) into the slot's request area, its rpc, seq, length and expiry,
 * clears its progress and busy words, marks it SUBMITTED (release order) and rings fd unless the
 * daemon looks at the slots unrung. */
static void put_request(unsigned long long ring, char *s, uint32_t rpc, uint64_t seq, const Py_buffer *data,
                        int fd, uint64_t expires) {
    uint32_t n = (uint32_t)data->len;
    memcpy(s + REQUEST_AT, data->buf, (size_t)data->len);
    memcpy(s + 4, &rpc, 4);
    memcpy(s + 8, &seq, 8);
    memcpy(s + 16, &n, 4);
    memset(s + 32, 0, 32); /* progress words: nothing of the last call */
    memset(s + BUSY_AT, 0, 4);
    memcpy(s + EXPIRES_AT, &expires, 8);
    __atomic_store_n((uint32_t *)s, 1u /* SUBMITTED */, __ATOMIC_RELEASE);
    /* The daemon clears its awake word, fences, then looks at the slots once more before it
     * sleeps: with this fence, it sees SUBMITTED there or this sees the word cleared and rings. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n((uint32_t *)((char *)(uintptr_t)ring + AWAKE_AT), __ATOMIC_RELAXED))
        (void)!send(fd, "s", 1, MSG_DONTWAIT | MSG_NOSIGNAL); /* full: the daemon has doorbells to read */
}

/* Whether data fits a slot's request area; else ValueError. */
static int fits(const Py_buffer *data) {
    if (data->len <= REQUEST_BYTES)
        return 1;
    PyErr_SetString(PyExc_ValueError, "a request larger than a slot");
    return 0;
}

static PyObject *submit(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int slot, fd;
    unsigned int rpc;
    unsigned long long seq, expires = 0;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "KiIKy*i|K", &ring, &slot, &rpc, &seq, &data, &fd, &expires))
        return NULL;
    if (bad_slot(ring, slot) || !fits(&data)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    put_request(ring, slot_at(ring, slot), rpc, seq, &data, fd, expires);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *nudge(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int fd;
    if (!PyArg_ParseTuple(args, "Ki", &ring, &fd))
        return NULL;
    const char *h = (const char *)(uintptr_t)ring;
    if (__atomic_load_n((const uint32_t *)(h + PLANE_AT), __ATOMIC_RELAXED) != PLANE_ASLEEP)
        Py_RETURN_FALSE;
    (void)!send(fd, "s", 1, MSG_DONTWAIT | MSG_NOSIGNAL); /* full: the daemon has doorbells to read */
    Py_RETURN_TRUE;
}

/* word(ring, slot, offset): the slot's 32-bit word at offset (in its 128-byte header), read with
 * an acquire load, so that what the caller reads of the slot after it is at least as new (the
 * daemon stores the state and step words with release stores, after what they publish). */
static PyObject *word(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int slot, offset;
    if (!PyArg_ParseTuple(args, "Kii", &ring, &slot, &offset))
        return NULL;
    if (bad_slot(ring, slot))
        return NULL;
    if (offset < 0 || offset > 124 || offset % 4) {
        PyErr_SetString(PyExc_ValueError, "not a word of the slot's header");
        return NULL;
    }
    char *s = slot_at(ring, slot);
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)(s + offset), __ATOMIC_ACQUIRE));
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* time.monotonic()'s clock, in seconds. */
static double monotonic(void) { return (double)mono_ns() * 1e-9; }

/* Spins that find the CPU shared (docs/lane.md, "Waiting"): a look that comes more than
 * CROWDED_GAP seconds after the last, another thread having run on this one's CPU meanwhile (the
 * yield between them handed it over, or the scheduler took it), ends the spin; CROWDED_STRIKES of
 * them, each within CROWDED_STRIKE_GAP of the last, and for the crowded window (crowded(): 1 s by
 * default, KVCLIENT_LANE_CROWDED_MS) this process's waits sleep at once instead of spinning:
 * spinning then takes the CPU from the threads that would answer the call (the daemon's data plane
 * among them) and from the engine's own, and a spinning waiter's answer waits for its next turn
 * on the CPU, where a sleeper woken by its doorbell runs at once. One such spin alone (a thread
 * that woke for a moment beside an idle engine) changes nothing. The first spin after the window
 * finds out whether the CPU is still shared. */
#define CROWDED_GAP 50e-6
#define CROWDED_STRIKES 3
#define CROWDED_STRIKE_GAP_NS 50000000LL
static int64_t crowded_window_ns = 1000000000LL; /* 0: spins are never cut short */
static int64_t crowded_until_ns;                 /* CLOCK_MONOTONIC; every thread's waits read it */
static int64_t crowded_last_ns;                  /* the last spin that found the CPU shared */
static int crowded_strikes;                      /* such spins in a row, each soon after the last */
static uint64_t crowded_noticed;                 /* such spins, since the module was loaded */

/* This thread's involuntary context switches so far (a yield that let another thread run counts
 * as one); -1 if the count cannot be read. */
static long switches(void) {
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : -1;
}

/* Whether a look that came late found the CPU shared: crowded windows are on, and another thread
 * ran on this one's CPU since `before` (switches()): not an interrupt's or the hypervisor's time,
 * which sleeping would not give back. */
static int shared_cpu(long before) {
    if (!__atomic_load_n(&crowded_window_ns, __ATOMIC_RELAXED) || before < 0)
        return 0;
    return switches() > before;
}

static int crowded_now(void) {
    return mono_ns() < __atomic_load_n(&crowded_until_ns, __ATOMIC_RELAXED);
}

/* A spin found the CPU shared. (Threads racing here at once may count one strike too few or
 * too many: the window then starts a spin sooner or later.) */
static void note_crowded(void) {
    int64_t now = mono_ns(), window = __atomic_load_n(&crowded_window_ns, __ATOMIC_RELAXED);
    int64_t last = __atomic_exchange_n(&crowded_last_ns, now, __ATOMIC_RELAXED);
    int strikes = 1;
    if (now - last <= CROWDED_STRIKE_GAP_NS)
        strikes = __atomic_add_fetch(&crowded_strikes, 1, __ATOMIC_RELAXED);
    else
        __atomic_store_n(&crowded_strikes, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&crowded_noticed, 1, __ATOMIC_RELAXED);
    if (window > 0 && strikes >= CROWDED_STRIKES) {
        __atomic_store_n(&crowded_until_ns, now + window, __ATOMIC_RELAXED);
        __atomic_store_n(&crowded_strikes, 0, __ATOMIC_RELAXED);
    }
}

static inline int slot_ready(const char *s, long long step) {
    if (acquire32(s) == ST_DONE)
        return 1;
    return step >= 0 && acquire32(s + STEP_AT) != (uint32_t)step;
}

/* Reads the doorbell's messages to EAGAIN: 1 at its end of file (or an error), else 0. */
static int drain(int fd) {
    char buf[16];
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r > 0)
            continue;
        if (r == 0)
            return 1;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : 1;
    }
}

/* Sleeps on fd, the slot's done doorbell, for up to `left` seconds unless the slot is ready, and
 * drains it if rung. The slot's waiting word says so meanwhile: stored, fenced, then a last look
 * (the daemon stores the slot's words, fences, then reads this word to decide whether to ring; one
 * of the two sees the other's store). Returns ppoll's result (0 if it did not sleep), with *err
 * its errno, *ended whether the doorbell read end of file and *slept whether it slept at all (not
 * if the last look found the slot ready). */
static int sleep_on(char *s, long long step, int fd, double left, int *err, int *ended, int *slept) {
    uint32_t *waiting = (uint32_t *)(s + WAITING_AT);
    if (left > 3600)
        left = 3600; /* a far (or infinite) deadline: the caller sleeps again */
    struct timespec ts = {.tv_sec = (time_t)left, .tv_nsec = (long)((left - (double)(time_t)left) * 1e9)};
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n = 0;
    *err = *ended = *slept = 0;
    /* 2 (the plane's WAIT_END): for the call's end only, which a step does not ring for */
    __atomic_store_n(waiting, step < 0 ? 2u : 1u, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!slot_ready(s, step)) {
        *slept = 1;
        Py_BEGIN_ALLOW_THREADS
        n = ppoll(&p, 1, &ts, NULL);
        *err = errno;
        if (n > 0)
            *ended = drain(fd);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(waiting, 0u, __ATOMIC_RELAXED);
    return n;
}

/* Waits for the slot as wait() says: 0, 1 or 2, or -1 with a signal handler's exception set.
 * *slept (if given) says whether a ready slot was found on waking from a sleep (the doorbell or
 * the nap's timer) rather than while looking: the caller was asleep when its answer came. */
static int wait_for(char *s, int fd, long long step, double spin, double deadline, double nap, int *slept) {
    int got = -1, n, err, ended, woke = 0;
    if (nap > deadline)
        nap = deadline;
    while (got < 0 && fd >= 0) { /* the nap: asleep, rung if the answer comes first */
        double left = nap - monotonic();
        if (left <= 0)
            break;
        n = sleep_on(s, step, fd, left, &err, &ended, &woke);
        if (slot_ready(s, step))
            got = 0;
        else if (ended || (n < 0 && err != EINTR))
            got = 1;
        else if (n < 0 && PyErr_CheckSignals())
            return -1;
        else if (n == 0)
            break; /* napped: look from now on */
    }
    if (got < 0)
        woke = 0; /* napped (or no nap): what follows first looks */
    if (got < 0 && spin > 0 && !crowded_now()) {
        Py_BEGIN_ALLOW_THREADS
        long switched = __atomic_load_n(&crowded_window_ns, __ATOMIC_RELAXED) ? switches() : -1;
        double t = monotonic(), last = t, until = t + spin;
        if (until > deadline)
            until = deadline;
        for (;;) {
            if (slot_ready(s, step)) {
                got = 0;
                break;
            }
            t = monotonic();
            if (t - last > CROWDED_GAP && shared_cpu(switched)) {
                note_crowded();
                break;
            }
            if (t >= until)
                break;
            sched_yield(); /* whatever else is runnable on this CPU goes first */
            last = t;
        }
        Py_END_ALLOW_THREADS
    }
    while (got < 0) {
        if (slot_ready(s, step)) {
            got = 0;
            break;
        }
        double left = deadline - monotonic();
        if (left <= 0) {
            got = 2;
            break;
        }
        if (fd < 0) { /* no doorbell left to wait on: closed */
            got = 1;
            break;
        }
        if (PyErr_CheckSignals()) /* one that came during the spin: its handler runs now */
            return -1;
        n = sleep_on(s, step, fd, left, &err, &ended, &woke);
        if (n < 0 && err != EINTR) {
            got = 1;
            break;
        }
        if (n < 0 && PyErr_CheckSignals())
            return -1;
        if (ended && !slot_ready(s, step))
            got = 1;
    }
    if (slept)
        *slept = got == 0 && woke;
    return got;
}

/* Whether the wait's times are ones wait() takes; else ValueError. */
static int good_times(double spin, double deadline, double nap) {
    if (spin >= 0 && spin <= 0.01 && !isnan(deadline) && isfinite(nap))
        return 1;
    PyErr_SetString(PyExc_ValueError, "spin must be between 0 and 10 ms, and the deadline and nap times");
    return 0;
}

static PyObject *wait_slot(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int slot, fd;
    long long step;
    double spin, deadline, nap = 0;
    if (!PyArg_ParseTuple(args, "KiiLdd|d", &ring, &slot, &fd, &step, &spin, &deadline, &nap))
        return NULL;
    if (bad_slot(ring, slot) || !good_times(spin, deadline, nap))
        return NULL;
    int got = wait_for(slot_at(ring, slot), fd, step, spin, deadline, nap, NULL);
    return got < 0 ? NULL : PyLong_FromLong(got);
}

/* The slot that args (ring_addr, slot) name; NULL with an exception set. */
static const char *slot_of_args(PyObject *args) {
    unsigned long long ring;
    int slot;
    if (!PyArg_ParseTuple(args, "Ki", &ring, &slot) || bad_slot(ring, slot))
        return NULL;
    return slot_at(ring, slot);
}

static PyObject *progress(PyObject *self, PyObject *args) {
    const char *s = slot_of_args(args);
    if (!s)
        return NULL;
    uint32_t state = acquire32(s), step = acquire32(s + STEP_AT);
    uint64_t nbytes;
    memcpy(&nbytes, s + 40, 8);
    return Py_BuildValue("(kkkKkkkk)", (unsigned long)state, (unsigned long)get32(s + 32),
                         (unsigned long)get32(s + 36), (unsigned long long)nbytes, (unsigned long)get32(s + 48),
                         (unsigned long)get32(s + 52), (unsigned long)step, (unsigned long)get32(s + 60));
}

/* (code, response, message, flags) of a DONE slot, lengths bounded by the areas they lie in (the
 * daemon's numbers are not trusted to stay inside the slot); slept >= 0 adds busy and slept. */
static PyObject *answer_of(const char *s, int slept) {
    (void)acquire32(s); /* what the state published */
    uint32_t code = get32(s + 20), n = get32(s + 24), m = get32(s + 28);
    if (n > RESPONSE_BYTES)
        n = RESPONSE_BYTES;
    if (m > ERROR_BYTES)
        m = ERROR_BYTES;
    if (slept >= 0)
        return Py_BuildValue("(ky#y#kki)", (unsigned long)code, s + RESPONSE_AT, (Py_ssize_t)n, s + ERROR_AT,
                             (Py_ssize_t)m, (unsigned long)get32(s + 60), (unsigned long)get32(s + BUSY_AT),
                             slept);
    return Py_BuildValue("(ky#y#k)", (unsigned long)code, s + RESPONSE_AT, (Py_ssize_t)n, s + ERROR_AT,
                         (Py_ssize_t)m, (unsigned long)get32(s + 60));
}

static PyObject *result(PyObject *self, PyObject *args) {
    const char *s = slot_of_args(args);
    return s ? answer_of(s, -1) : NULL;
}

/* call(ring, slot, rpc, seq, data, submit_fd, done_fd, spin, deadline, nap, expires): submit() then wait()
 * (step -1) in one call; the slot's answer (code, response, message, flags, busy, slept) once it
 * is DONE (even if the doorbell closed after), else wait()'s 1 or 2. */
static PyObject *call(PyObject *self, PyObject *args) {
    unsigned long long ring, seq, expires = 0;
    int slot, submit_fd, done_fd;
    unsigned int rpc;
    Py_buffer data;
    double spin, deadline, nap;
    if (!PyArg_ParseTuple(args, "KiIKy*iiddd|K", &ring, &slot, &rpc, &seq, &data, &submit_fd, &done_fd, &spin,
                          &deadline, &nap, &expires))
        return NULL;
    if (bad_slot(ring, slot) || !good_times(spin, deadline, nap) || !fits(&data)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    char *s = slot_at(ring, slot);
    put_request(ring, s, rpc, seq, &data, submit_fd, expires);
    PyBuffer_Release(&data);
    int slept = 0;
    int got = wait_for(s, done_fd, -1, spin, deadline, nap, &slept);
    if (got < 0)
        return NULL;
    if (acquire32(s) == ST_DONE)
        return answer_of(s, slept);
    return PyLong_FromLong(got);
}

/* crowded([window]) -> (window, left, noticed): the seconds CROWDED_STRIKES spins that found the
 * CPU shared keep this process's waits from spinning (0: spins are never cut short), the seconds
 * left of the current such time, and the spins that found the CPU shared so far. With window (0
 * to 3600), it is set first, and the current time without spins ends, its strikes forgotten. */
static PyObject *crowded(PyObject *self, PyObject *args) {
    double window = -1;
    if (!PyArg_ParseTuple(args, "|d", &window))
        return NULL;
    if (PyTuple_GET_SIZE(args)) {
        if (!(window >= 0 && window <= 3600)) {
            PyErr_SetString(PyExc_ValueError, "a crowded window of 0 to 3600 seconds");
            return NULL;
        }
        __atomic_store_n(&crowded_window_ns, (int64_t)(window * 1e9), __ATOMIC_RELAXED);
        __atomic_store_n(&crowded_until_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&crowded_strikes, 0, __ATOMIC_RELAXED);
    }
    int64_t left = __atomic_load_n(&crowded_until_ns, __ATOMIC_RELAXED) - mono_ns();
    return Py_BuildValue("(ddK)", (double)__atomic_load_n(&crowded_window_ns, __ATOMIC_RELAXED) * 1e-9,
                         left > 0 ? (double)left * 1e-9 : 0.0,
                         (unsigned long long)__atomic_load_n(&crowded_noticed, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"crowded", crowded, METH_VARARGS, NULL},
    {"pack", pack, METH_VARARGS, NULL},
    {"submit", submit, METH_VARARGS, NULL},
    {"nudge", nudge, METH_VARARGS, NULL},
    {"word", word, METH_VARARGS, NULL},
    {"wait", wait_slot, METH_VARARGS, NULL},
    {"progress", progress, METH_VARARGS, NULL},
    {"result", result, METH_VARARGS, NULL},
    {"call", call, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) { return kv_with_sources(PyModule_Create(&module)); }
