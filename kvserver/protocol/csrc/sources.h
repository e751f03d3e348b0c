/* The digest of the sources an extension was built from, compiled in by setup.py
 * (kvserver/protocol/compiled.py): its callers take the extension only if it is the digest of the
 * sources beside it. */
#ifndef KV_SOURCES_H
#define KV_SOURCES_H

#include <Python.h>

#ifndef KV_SOURCES
#define KV_SOURCES "" /* built without setup.py: the digest of no sources */
#endif

/* m with its SOURCES constant; NULL if m is, or (m released) if the constant cannot be added. */
static inline PyObject *kv_with_sources(PyObject *m) {
    if (m && PyModule_AddStringConstant(m, "SOURCES", KV_SOURCES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif
