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
 * submit(ring_addr, slot, rpc, seq, data, fd): writes data into the slot's request area, its rpc,
 *   seq and length, clears its progress words, marks it SUBMITTED (release order) and rings fd.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#include "../../lane/csrc/request.h"

#define HEADER_BYTES 64
#define SLOT_BYTES (128 + 64 * 1024 + 1024 + 3 * 1024)
#define REQUEST_AT 128
#define REQUEST_BYTES (64 * 1024)

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

static PyObject *submit(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int slot, fd;
    unsigned int rpc;
    unsigned long long seq;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "KiIKy*i", &ring, &slot, &rpc, &seq, &data, &fd))
        return NULL;
    if (slot < 0 || slot >= 64 || data.len > REQUEST_BYTES) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "no such slot, or a request larger than a slot");
        return NULL;
    }
    char *s = (char *)(uintptr_t)ring + HEADER_BYTES + (size_t)slot * SLOT_BYTES;
    uint32_t n = (uint32_t)data.len;
    memcpy(s + REQUEST_AT, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    memcpy(s + 4, &rpc, 4);
    memcpy(s + 8, &seq, 8);
    memcpy(s + 16, &n, 4);
    memset(s + 32, 0, 32); /* progress words: nothing of the last call */
    __atomic_store_n((uint32_t *)s, 1u /* SUBMITTED */, __ATOMIC_RELEASE);
    (void)!send(fd, "s", 1, MSG_DONTWAIT | MSG_NOSIGNAL); /* full: the daemon has doorbells to read */
    Py_RETURN_NONE;
}

/* word(ring, slot, offset): the slot's 32-bit word at offset (in its 128-byte header), read with
 * an acquire load, so that what the caller reads of the slot after it is at least as new (the
 * daemon stores the state and step words with release stores, after what they publish). */
static PyObject *word(PyObject *self, PyObject *args) {
    unsigned long long ring;
    int slot, offset;
    if (!PyArg_ParseTuple(args, "Kii", &ring, &slot, &offset))
        return NULL;
    if (slot < 0 || slot >= 64 || offset < 0 || offset > 124 || offset % 4) {
        PyErr_SetString(PyExc_ValueError, "no such slot, or not a word of its header");
        return NULL;
    }
    char *s = (char *)(uintptr_t)ring + HEADER_BYTES + (size_t)slot * SLOT_BYTES;
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)(s + offset), __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, NULL},
    {"submit", submit, METH_VARARGS, NULL},
    {"word", word, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
