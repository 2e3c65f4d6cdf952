/* mpidist.backends._shm: the counters of the shared-memory path (backends/shm.py), with C11 memory order.
 *
 * Ranks of one node hand each other chunks of a collective through shared memory.
 * A rank writes a chunk (numpy copies and ufuncs), then raises its counter; the
 * others read the counter, then the chunk. On x86-64 the CPU keeps stores in order
 * and loads in order, and the interpreter's calls keep the compiler from moving
 * them; on other CPUs (aarch64, POWER) only fences do. So:
 *
 *   publish(address, value)        a release store of the int64 at address: every
 *                                  write this process made before is visible to a
 *                                  rank that sees value;
 *   least(address, count, stride)  the smallest of count int64 counters, stride bytes
 *                                  apart, each an acquire load: the chunks they
 *                                  announce can be read after it returns.
 *
 * Addresses come from Python (the mapped segment's numpy views) and are checked
 * there; nothing here allocates or keeps a reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish(address, value)");
        return NULL;
    }
    uintptr_t address = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    long long value = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    __atomic_store_n((int64_t *)address, (int64_t)value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *least(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "least(address, count, stride)");
        return NULL;
    }
    uintptr_t address = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    int64_t low = INT64_MAX;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t v = __atomic_load_n((int64_t *)(address + (uintptr_t)(k * stride)), __ATOMIC_ACQUIRE);
        if (v < low) low = v;
    }
    return PyLong_FromLongLong(low);
}

static PyMethodDef methods[] = {
    {"publish", (PyCFunction)(void (*)(void))publish, METH_FASTCALL, "Release-store an int64 counter."},
    {"least", (PyCFunction)(void (*)(void))least, METH_FASTCALL, "The smallest of int64 counters (acquire loads)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shm",
                                    "Counters of the shared-memory path with C11 memory order.", -1, methods};

PyMODINIT_FUNC PyInit__shm(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    if (m != NULL) PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED); /* the counters' callers assume the GIL */
#endif
    return m;
}
