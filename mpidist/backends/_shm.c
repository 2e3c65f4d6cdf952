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
 *                                  announce can be read after it returns;
 *   await_any(stride, budget, (address, count, target) x 3)
 *                                  whether, within a bounded wait with the GIL
 *                                  released, least(address, count, stride) reached
 *                                  target for any of the three (one of 0 counters is
 *                                  not looked at): a blocking call's wait for the
 *                                  next phase, instead of a Python test every few us;
 *   read_from(pid, remote, local, nbytes)
 *                                  copy nbytes at address remote of process pid to
 *                                  local with the kernel's cross-memory attach
 *                                  (process_vm_readv): the one-copy collectives.
 *
 * Addresses come from Python (the mapped segment's numpy views) and are checked
 * there; nothing here allocates or keeps a reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <sys/uio.h>
#include <time.h>

static inline int64_t least_of(uintptr_t address, Py_ssize_t count, Py_ssize_t stride) {
    int64_t low = INT64_MAX;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t v = __atomic_load_n((int64_t *)(address + (uintptr_t)(k * stride)), __ATOMIC_ACQUIRE);
        if (v < low) low = v;
    }
    return low;
}

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
    return PyLong_FromLongLong(least_of(address, count, stride));
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Looks between two reads of the clock. */
#define LOOKS_PER_CLOCK 64

/* await_any(stride, budget_ns, a1, n1, t1, a2, n2, t2, a3, n3, t3) -> bool
 *
 * Looks at the three conditions least(a_k, n_k, stride) >= t_k until one holds (True) or
 * |budget_ns| has passed (False), with the GIL released. A negative budget (a node with more ranks
 * than cores) yields the CPU between looks, so that the rank waited for runs; otherwise it spins on the
 * loads alone. (A pause instruction between looks, 16 or 256 per look, measured no faster on 2 ranks, and
 * in a virtual machine a run of pauses can make the hypervisor take the core away: pause-loop exiting.)
 * The caller (SharedOp) returns to Python when the budget ends, so the group's
 * timeout, the stall diagnosis and Ctrl-C act within it. */
static PyObject *await_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "await_any(stride, budget_ns, a1, n1, t1, a2, n2, t2, a3, n3, t3)");
        return NULL;
    }
    Py_ssize_t stride = PyLong_AsSsize_t(args[0]);
    long long budget = PyLong_AsLongLong(args[1]);
    uintptr_t address[3];
    Py_ssize_t count[3];
    int64_t target[3];
    for (int k = 0; k < 3; k++) {
        address[k] = (uintptr_t)PyLong_AsUnsignedLongLong(args[2 + 3 * k]);
        count[k] = PyLong_AsSsize_t(args[3 + 3 * k]);
        target[k] = (int64_t)PyLong_AsLongLong(args[4 + 3 * k]);
    }
    if (PyErr_Occurred()) return NULL;
    int yielding = budget < 0, met = 0;
    if (yielding) budget = -budget;
    Py_BEGIN_ALLOW_THREADS
    long long end = now_ns() + budget;
    for (;;) {
        for (int look = 0; look < (yielding ? 1 : LOOKS_PER_CLOCK) && !met; look++) { /* a yield may take ms */
            for (int k = 0; k < 3 && !met; k++)
                met = count[k] > 0 && least_of(address[k], count[k], stride) >= target[k];
            if (met) break;
            if (yielding) sched_yield();
        }
        if (met || now_ns() > end) break;
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(met);
}

/* read_from(pid, remote, local, nbytes) -> None, or OSError (EPERM where the kernel forbids it, ESRCH, EFAULT)
 *
 * One copy from another process's memory, with the GIL released; a partial read (a call returns less than
 * asked) goes on where it stopped. */
static PyObject *read_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read_from(pid, remote, local, nbytes)");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]);
    uintptr_t remote = (uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    uintptr_t local = (uintptr_t)PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (nbytes > 0) {
        struct iovec here = {(void *)local, (size_t)nbytes}, there = {(void *)remote, (size_t)nbytes};
        ssize_t got = process_vm_readv((pid_t)pid, &here, 1, &there, 1, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (got == 0) {
            err = EFAULT;
            break;
        }
        local += (uintptr_t)got;
        remote += (uintptr_t)got;
        nbytes -= got;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"publish", (PyCFunction)(void (*)(void))publish, METH_FASTCALL, "Release-store an int64 counter."},
    {"least", (PyCFunction)(void (*)(void))least, METH_FASTCALL, "The smallest of int64 counters (acquire loads)."},
    {"await_any", (PyCFunction)(void (*)(void))await_any, METH_FASTCALL,
     "Wait, bounded and with the GIL released, until one of three counter conditions holds."},
    {"read_from", (PyCFunction)(void (*)(void))read_from, METH_FASTCALL,
     "Copy bytes out of another process's memory (process_vm_readv)."},
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
