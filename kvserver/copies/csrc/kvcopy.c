/* One-pass scattered row copies for the daemon's host <-> shared-memory transfers.
 *
 * copy_rows(dst, dst_offsets, src, src_offsets, n, row_bytes[, stream]) copies n rows of row_bytes
 * each, row i from src + src_offsets[i] to dst + dst_offsets[i] (streamed as copy_layers does).
 *
 * copy_layers(dst_bases, src_bases, num_buffers, parts, dst_offsets, src_offsets, n, row_bytes,
 *             progress, eventfd, signal_interval_ns, stop, progress_base, stream) does the same for
 * num_buffers (layer, part) buffer pairs, whose base addresses are arrays of uint64, with the same
 * row offsets in each. After each group of `parts` buffers (one layer) it stores progress_base +
 * the number of layers done in *progress (if not 0; a job copied in pieces passes the layers its
 * earlier pieces did), and adds 1 to the eventfd (if >= 0) when signal_interval_ns have passed
 * since the last signal, and always after the last layer. An event loop can so stream per-layer
 * progress while this thread copies without ever taking the GIL, woken at most once an interval.
 * Before each layer it reads *stop (if not 0): once another thread has set it, the copy ends at
 * that layer boundary. It returns the number of layers copied. With stream set (a job of
 * STREAM_MIN_JOB bytes or more, of which this call may be a piece) rows are copied with streaming
 * stores, fenced before each progress store and before it returns (stream.h).
 *
 * page_sums(base, offsets, n, nbytes, seeds, out) writes into out[i] (uint32) the CRC-32C of the
 * nbytes at base + offsets[i], started from seeds[i]: the disk tier's check of a page's bytes. It
 * uses the SSE 4.2 crc32 instruction where the CPU has it, a table elsewhere (same result).
 *
 * Addresses are integers (tensor data_ptr values); offsets are arrays of int64 byte offsets. The
 * caller has checked every offset against its buffer. No threads are started: the daemon decides
 * how many copies run at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "stream.h"
#include "../../protocol/csrc/sources.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void copy_n(char *d, const int64_t *doff, const char *s, const int64_t *soff, Py_ssize_t n,
                   size_t row_bytes, int stream) {
    for (Py_ssize_t i = 0; i < n; i++)
        kv_copy(d + doff[i], s + soff[i], row_bytes, stream);
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long dst, dst_offsets, src, src_offsets;
    Py_ssize_t n, row_bytes;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "KKKKnn|p", &dst, &dst_offsets, &src, &src_offsets, &n, &row_bytes, &stream))
        return NULL;
    if (n < 0 || row_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "n and row_bytes must not be negative");
        return NULL;
    }
    char *d = (char *)(uintptr_t)dst;
    const char *s = (const char *)(uintptr_t)src;
    const int64_t *doff = (const int64_t *)(uintptr_t)dst_offsets;
    const int64_t *soff = (const int64_t *)(uintptr_t)src_offsets;
    Py_BEGIN_ALLOW_THREADS
    copy_n(d, doff, s, soff, n, (size_t)row_bytes, stream);
    kv_copy_fence(stream);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *copy_layers(PyObject *self, PyObject *args) {
    unsigned long long dst_bases, src_bases, dst_offsets, src_offsets, progress, stop_word = 0;
    Py_ssize_t num_buffers, parts, n, row_bytes;
    int efd;
    long long interval_ns = 0, base = 0;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "KKnnKKnnKi|LKLp", &dst_bases, &src_bases, &num_buffers, &parts,
                          &dst_offsets, &src_offsets, &n, &row_bytes, &progress, &efd, &interval_ns,
                          &stop_word, &base, &stream))
        return NULL;
    if (num_buffers < 0 || parts <= 0 || n < 0 || row_bytes < 0 || num_buffers % parts) {
        PyErr_SetString(PyExc_ValueError, "bad buffer, part or row counts");
        return NULL;
    }
    const uint64_t *db = (const uint64_t *)(uintptr_t)dst_bases;
    const uint64_t *sb = (const uint64_t *)(uintptr_t)src_bases;
    const int64_t *doff = (const int64_t *)(uintptr_t)dst_offsets;
    const int64_t *soff = (const int64_t *)(uintptr_t)src_offsets;
    int64_t *done = (int64_t *)(uintptr_t)progress;
    const int64_t *stop = (const int64_t *)(uintptr_t)stop_word;
    int failed = 0;
    Py_ssize_t layers = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t last_signal = now_ns();
    for (Py_ssize_t b = 0; b < num_buffers; b++) {
        if (b % parts == 0 && stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE))
            break;
        copy_n((char *)(uintptr_t)db[b], doff, (const char *)(uintptr_t)sb[b], soff, n, (size_t)row_bytes,
               stream);
        if ((b + 1) % parts == 0) {
            kv_copy_fence(stream); /* the layer's bytes are there before its progress says so */
            layers = (b + 1) / parts;
            if (done)
                __atomic_store_n(done, (int64_t)(base + (b + 1) / parts), __ATOMIC_RELEASE);
            int64_t t = now_ns();
            if (efd >= 0 && (b + 1 == num_buffers || t - last_signal >= interval_ns)) {
                last_signal = t;
                uint64_t one = 1;
                if (write(efd, &one, sizeof one) != sizeof one)
                    failed = 1;
            }
        }
    }
    kv_copy_fence(stream); /* and before the caller hears the call is over (a stop mid-layer too) */
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromSsize_t(layers);
}

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as iSCSI and ext4 use it. */
static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static int have_hw_crc = 0;

static uint32_t crc32c(uint32_t crc, const unsigned char *p, size_t n) {
#if defined(__x86_64__)
    if (have_hw_crc)
        return crc32c_hw(crc, p, n);
#endif
    return crc32c_table(crc, p, n);
}

static PyObject *page_sums(PyObject *self, PyObject *args) {
    unsigned long long base, offsets, seeds, out;
    Py_ssize_t n, nbytes;
    if (!PyArg_ParseTuple(args, "KKnnKK", &base, &offsets, &n, &nbytes, &seeds, &out))
        return NULL;
    if (n < 0 || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "n and nbytes must not be negative");
        return NULL;
    }
    const unsigned char *b = (const unsigned char *)(uintptr_t)base;
    const int64_t *off = (const int64_t *)(uintptr_t)offsets;
    const uint32_t *seed = (const uint32_t *)(uintptr_t)seeds;
    uint32_t *o = (uint32_t *)(uintptr_t)out;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        o[i] = crc32c(seed[i], b + off[i], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *crc32c_bytes(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed))
        return NULL;
    uint32_t c = crc32c(seed, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *streams(PyObject *self, PyObject *args) {
    int load;
    long long job_bytes;
    if (!PyArg_ParseTuple(args, "pL", &load, &job_bytes))
        return NULL;
    return PyBool_FromLong(kv_streams(load, job_bytes));
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, "Copy n rows between scattered byte offsets."},
    {"copy_layers", copy_layers, METH_VARARGS, "copy_rows over many buffers, with per-layer progress."},
    {"streams", streams, METH_VARARGS, "Whether a job (load, bytes) is copied with streaming stores."},
    {"page_sums", page_sums, METH_VARARGS, "CRC-32C of n pages at scattered offsets, each from its seed."},
    {"crc32c", crc32c_bytes, METH_VARARGS, "CRC-32C of a bytes-like object, from a seed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvcopy(void) {
    crc_table_init();
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw_crc = __builtin_cpu_supports("sse4.2");
#endif
    PyObject *m = kv_with_sources(PyModule_Create(&module));
    if (m && PyModule_AddIntConstant(m, "STREAM_MIN_JOB", KV_STREAM_MIN_JOB) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
