/* The compiled data plane: serves the fast lane's binary Write and Load (request.h) on its own
 * thread, without the GIL and without the event loop (docs/design.md, "The data plane").
 *
 * One Engine per daemon runs one thread. It watches every lane's submit doorbell with epoll; a
 * wake-up drains the doorbell and looks once at each slot it is not already serving. While it
 * spins with no copy to run (and few lanes: AWAKE_MAX_SLOTS) it says so in every ring's awake word
 * and looks at every slot itself, so that clients need not ring (docs/lane.md, "Ringing only a
 * sleeper"). A SUBMITTED slot is marked TAKEN and its request copied out of the ring. A
 * binary Write or Load that kv_accept() finds certainly valid, for a registration whose Gate is
 * open and which has no copy running on the Python side, becomes a job here: its host pages are
 * checked as allocated and marked busy under the Gate's lock (the lock Free takes), and it is
 * copied in pieces of at most PIECE_BYTES, loads before writes (a load waits only for the earlier
 * writes of its registration that touch its pages or slots, as kvserver/copies/order.py orders
 * them), publishing each load's per-layer progress in the slot and ringing its done doorbell (at
 * most once per progress interval before the end, and on a quiet ring only for a client that
 * sleeps there). A lane Get (protobuf) of a registration whose Gate knows its cache part
 * (set_cache) is served whole here too (try_get): read and checked (get.h), its keys walked in the
 * cache's index and its pages held under the cache's lock, which this thread only tries for a few
 * microseconds (cache.h), copied as a Load is, its end posted back with the pages it held
 * (take_gets); and so is the engine's Lookup of that part (try_answer), walked and answered,
 * nothing held, a scheduler's Lookup of a whole space on its space's lane, and a Put (try_put),
 * answered at once where its keys are stored, else copied into pages the loop set aside for it.
 * A CUDA pool's Write or Load (KVSERVER_PLANE_CUDA=1) is put on its stream through the driver's
 * entry points and completed by polling its events. Everything else (the other protobuf calls, a
 * CUDA pool's Gets, Lookups and Puts, any request the check refuses) is handed to Python in
 * arrival order through a queue and an eventfd, and answered there by the one validation. The
 * loop's copies of a registration (a Put's, a Get's) come back here to be copied (submit_copy),
 * their ends posted on the same eventfd; a lane Get's copy also answers its slot here, as a Load's
 * job does.
 *
 * Python changes what the thread uses only through commands that the thread carries out between
 * pieces and acknowledges (add or remove a lane, close a gate): once remove_lane() returns, the
 * thread no longer touches that ring or its sockets. A Gate's addresses (host region, device
 * buffers) stay valid until close_gate() returns; its jobs are stopped there.
 *
 * This file is the extension module: its Python types' tables and its init. The rest is in parts it
 * includes once, in this order (each part sees what the ones before it define):
 *   plane.h        the ring's layout and the types: Gate, Lane, Job, Engine, what goes to the loop
 *   gate.h         a Gate's methods: its pages, its cache part, its space, the checks the loop asks
 *   gate_cuda.h    a CUDA pool's gate: driver entry points, stream, events, copy kernel, ready events
 *   jobs.h         a lane's binary Write or Load taken as a job (try_job), hand-offs to the loop
 *   serve_get.h    a lane Get served whole (try_get), a Lookup answered (try_answer)
 *   serve_put.h    a lane Put served whole (try_put)
 *   slots.h        a lane's slots: scanning, doorbells, progress words, a job's end and answer
 *   cuda_jobs.h    a CUDA job put on its pool's stream and completed by polling its events
 *   work.h         the order of a registration's copies, and copying them piece by piece
 *   thread.h       the plane's thread: commands, the loop's submissions, its wait, spin and nap
 *   engine.h       the Engine's methods: start, stop, lanes, hand-offs, histograms, counters
 *   loop_copies.h  the loop's copies the plane runs (submit_copy) and their ends
 *   engine_cache.h the node-wide cache on the plane: set_cache, the Put stash, the ends of its calls
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../copies/csrc/stream.h"
#include "cache.h"
#include "cuda.h"
#include "get.h"
#include "request.h"
#include "../../protocol/csrc/sources.h"

#include "plane.h"
#include "gate.h"
#include "gate_cuda.h"

/* The Gate type, here rather than at the end: the Engine's methods (included below) check their
 * arguments against GateType. */
static PyMethodDef gate_methods[] = {
    {"set_cuda", (PyCFunction)gate_set_cuda, METH_VARARGS, NULL},
    {"add_ready", (PyCFunction)gate_add_ready, METH_VARARGS, NULL},
    {"set_cuda_kernels", (PyCFunction)gate_set_cuda_kernels, METH_VARARGS, NULL},
    {"set_cache", (PyCFunction)gate_set_cache, METH_VARARGS, NULL},
    {"set_space", (PyCFunction)gate_set_space, METH_VARARGS, NULL},
    {"check_call", (PyCFunction)gate_check_call, METH_VARARGS, NULL},
    {"release_if_idle", (PyCFunction)gate_release_if_idle, METH_O, NULL},
    {"py_enter", (PyCFunction)gate_py_enter, METH_NOARGS, NULL},
    {"py_exit", (PyCFunction)gate_py_exit, METH_NOARGS, NULL},
    {"take_counters", (PyCFunction)gate_take_counters, METH_NOARGS, NULL},
    {"take_lookups", (PyCFunction)gate_take_lookups, METH_NOARGS, NULL},
    {"check", (PyCFunction)gate_check, METH_O, NULL},
    {"shut", (PyCFunction)gate_shut, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef gate_getset[] = {
    {"inflight", (getter)gate_get_inflight, NULL, NULL, NULL},
    {"x_inflight", (getter)gate_get_x_inflight, NULL, NULL, NULL},
    {"py_inflight", (getter)gate_get_py_inflight, NULL, NULL, NULL},
    {"closed", (getter)gate_get_closed, NULL, NULL, NULL},
    {"cache_gid", (getter)gate_get_cache_gid, NULL, NULL, NULL},
    {"space", (getter)gate_get_space, NULL, NULL, NULL},
    {"stashed", (getter)gate_get_stashed, NULL, NULL, NULL},
    {"stash_short", (getter)gate_get_stash_short, NULL, NULL, NULL},
    {"cuda", (getter)gate_get_cuda, NULL, NULL, NULL},
    {"cuda_failed", (getter)gate_get_cuda_failed, NULL, NULL, NULL},
    {"cuda_jobs", (getter)gate_get_cuda_jobs, NULL, NULL, NULL},
    {"cuda_kernel_jobs", (getter)gate_get_cuda_kernel_jobs, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvserver.lane._kvlane.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
};

#include "jobs.h"
#include "serve_get.h"
#include "serve_put.h"
#include "slots.h"
#include "cuda_jobs.h"
#include "work.h"
#include "thread.h"
#include "engine.h"
#include "loop_copies.h"
#include "engine_cache.h"

static PyMethodDef engine_methods[] = {
    {"new_lane", (PyCFunction)engine_new_lane, METH_VARARGS, NULL},
    {"watch_lane", (PyCFunction)engine_watch_lane, METH_O, NULL},
    {"remove_lane", (PyCFunction)engine_remove_lane, METH_O, NULL},
    {"finish_slot", (PyCFunction)engine_finish_slot, METH_VARARGS, NULL},
    {"close_gate", (PyCFunction)engine_close_gate, METH_O, NULL},
    {"unwatch_all", (PyCFunction)engine_unwatch_all, METH_NOARGS, NULL},
    {"pause", (PyCFunction)engine_pause, METH_O, NULL},
    {"take_handoffs", (PyCFunction)engine_take_handoffs, METH_NOARGS, NULL},
    {"submit_copy", (PyCFunction)(void (*)(void))engine_submit_copy, METH_VARARGS | METH_KEYWORDS, NULL},
    {"take_completions", (PyCFunction)engine_take_completions, METH_NOARGS, NULL},
    {"set_cache", (PyCFunction)engine_set_cache, METH_O, NULL},
    {"take_gets", (PyCFunction)engine_take_gets, METH_VARARGS, NULL},
    {"stash", (PyCFunction)engine_stash, METH_VARARGS, NULL},
    {"unstash", (PyCFunction)engine_unstash, METH_O, NULL},
    {"take_histograms", (PyCFunction)engine_take_histograms, METH_NOARGS, NULL},
    {"stop", (PyCFunction)engine_stop, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef engine_getset[] = {
    {"notify_fd", (getter)engine_get_notify_fd, NULL, NULL, NULL},
    {"jobs", (getter)engine_get_jobs, NULL, NULL, NULL},
    {"served", (getter)engine_get_served, NULL, NULL, NULL},
    {"handed", (getter)engine_get_handed, NULL, NULL, NULL},
    {"command_cuts", (getter)engine_get_command_cuts, NULL, NULL, NULL},
    {"command_delay_us", (getter)engine_get_command_delay_us, (setter)engine_set_command_delay_us, NULL, NULL},
    {"naps", (getter)engine_get_naps, NULL, NULL, NULL},
    {"mutes", (getter)engine_get_mutes, NULL, NULL, NULL},
    {"ends_waiting", (getter)engine_get_ends_waiting, NULL, NULL, NULL},
    {"plane_gets", (getter)engine_get_plane_gets, NULL, NULL, NULL},
    {"plane_lookups", (getter)engine_get_plane_lookups, NULL, NULL, NULL},
    {"plane_space_lookups", (getter)engine_get_plane_space_lookups, NULL, NULL, NULL},
    {"plane_puts", (getter)engine_get_plane_puts, NULL, NULL, NULL},
    {"plane_stores", (getter)engine_get_plane_stores, NULL, NULL, NULL},
    {"write_turns", (getter)engine_get_write_turns, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvserver.lane._kvlane.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_getset = engine_getset,
};

/* space_gate() -> Gate: the gate of a scheduler's lane of one KV space (Gate.space): it answers
 * that space's Lookups once set_space gives it the space's parts, and hands every other request
 * to the loop. */
static PyObject *module_space_gate(PyObject *mod, PyObject *unused) {
    Gate *g = (Gate *)PyType_GenericNew(&GateType, NULL, NULL);
    if (!g)
        return NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->check_mu, NULL);
    g->cache_gid = -1;
    g->space = 1;
    return (PyObject *)g;
}

static PyMethodDef module_methods[] = {
    {"space_gate", module_space_gate, METH_NOARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvlane", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__kvlane(void) {
    if (PyType_Ready(&GateType) < 0 || PyType_Ready(&EngineType) < 0 || PyType_Ready(&CacheType) < 0)
        return NULL;
    PyObject *m = kv_with_sources(PyModule_Create(&module));
    if (!m)
        return NULL;
    Py_INCREF(&GateType);
    Py_INCREF(&EngineType);
    PyModule_AddObject(m, "Gate", (PyObject *)&GateType);
    PyModule_AddObject(m, "Engine", (PyObject *)&EngineType);
    Py_INCREF(&CacheType);
    PyModule_AddObject(m, "Cache", (PyObject *)&CacheType);
    if (PyModule_AddIntConstant(m, "FORMAT_VERSION", KV_REQ_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
