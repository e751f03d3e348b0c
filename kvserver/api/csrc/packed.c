/* kvserver.api._packed: a large request's packed index lists decoded without the GIL
 * (kvserver/api/wire.py; varint.h has the format).
 *
 * count(payload) -> the number of values a well-formed payload holds.
 * decode(payload, out) -> how many values were written into out (a writable, C-contiguous buffer
 *   of 8-byte items); ValueError if the payload is not a well-formed packed list or out is too
 *   small. payload is any bytes-like object; both release the GIL while they read it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "varint.h"
#include "../../protocol/csrc/sources.h"

static PyObject *count(PyObject *self, PyObject *args) {
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "y*", &in))
        return NULL;
    size_t n;
    Py_BEGIN_ALLOW_THREADS
    n = kv_varint_count((const uint8_t *)in.buf, (size_t)in.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    return PyLong_FromSize_t(n);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "y*w*", &in, &out))
        return NULL;
    if (out.itemsize != 8 || !PyBuffer_IsContiguous(&out, 'C') || out.len % 8) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "out must be a C-contiguous buffer of 8-byte items");
        return NULL;
    }
    int64_t got;
    Py_BEGIN_ALLOW_THREADS
    got = kv_varints((const uint8_t *)in.buf, (size_t)in.len, (uint64_t *)out.buf, (size_t)out.len / 8);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    if (got < 0) {
        PyErr_SetString(PyExc_ValueError, got == KV_VARINT_CUT    ? "a packed list ends inside a varint"
                                          : got == KV_VARINT_LONG ? "a varint is longer than ten bytes"
                                                                  : "more values than out has room for");
        return NULL;
    }
    return PyLong_FromLongLong(got);
}

static PyMethodDef methods[] = {
    {"count", count, METH_VARARGS, "The number of values a well-formed packed varint list holds."},
    {"decode", decode, METH_VARARGS, "Decodes a packed varint list into an int64 buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_packed", NULL, -1, methods};

PyMODINIT_FUNC PyInit__packed(void) { return kv_with_sources(PyModule_Create(&module)); }
