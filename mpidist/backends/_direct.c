/* mpidist.backends._direct: the MPI backend's hot collectives as one C call each.
 *
 * mpi4py spends about 0.4 us of Python-level work on every call (message parsing,
 * a Request object) around an MPI call that itself takes 0.1 us on one node. For
 * the collectives a training loop or a solver repeats, this module makes the MPI
 * call directly: it posts the nonblocking collective on a C-contiguous numpy
 * array and tests it up to `spins` times, with the GIL released, and returns
 *
 *   None              the operation is complete (only when spins > 0);
 *   a request handle  (an int, as mpi4py's `Request.handle`) still pending;
 *   whatever `fallback.<method>(*args)` returns, for any argument it does not
 *                     take (not a numpy array, a count past INT_MAX, ...): the
 *                     same call made through mpi4py (mpidist/backends/direct.py).
 *
 * An MPI error raises `mpi4py.MPI.Exception(code)`, as mpi4py does.
 *
 * Only public contracts are used, and no MPI header is needed:
 *
 * - the MPI functions are the ones mpi4py's extension module is linked with (dlsym on it);
 * - MPI handles come from mpi4py's C API: PyMPIDatatype_Get and PyMPIOp_Get, the capsules of
 *   `mpi4py.MPI.__pyx_capi__` (what mpi4py's own include/mpi4py/pycapi.h imports, checked by their
 *   signatures), and the communicator's integer `Comm.handle`. The capsules rather than integer
 *   handles resolved once per datatype and op in the type table: the calls keep taking mpi4py's
 *   objects, so whatever they hand to mpi4py (the fallback) gets the very arguments it was given,
 *   and mpi4py itself says where an object's handle is (one indirect call, a few ns). Two handle
 *   ABIs exist: int handles (MPICH and its derivatives) and pointer handles (Open MPI, the MPI-5
 *   standard ABI); `bind` says which, and direct.py checks the result against mpi4py's `.handle`
 *   before any group uses it;
 * - arrays through numpy's C API (PyArray_* after import_array).
 *
 * The module keeps process-wide state (the bound library), so it uses single-phase initialization
 * and declares that it needs the GIL on free-threaded Python (3.13+).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <limits.h>
#include <sched.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION /* the oldest numpy mpidist supports (pyproject.toml) */
#include <numpy/arrayobject.h>

typedef void *fn_t; /* a function found by dlsym (POSIX: converts to a function pointer) */

/* the MPI functions, by name, as found in the library mpi4py uses */
static const char *NAMES[] = {"MPI_Iallreduce", "MPI_Ireduce", "MPI_Ibcast", "MPI_Iallgather",
                              "MPI_Ireduce_scatter_block", "MPI_Ialltoall", "MPI_Ibarrier",
                              "MPI_Test", NULL};
enum { FN_IALLREDUCE, FN_IREDUCE, FN_IBCAST, FN_IALLGATHER, FN_IRSB, FN_IALLTOALL, FN_IBARRIER, FN_TEST, FN_COUNT };

static struct {
    int bound;
    int int_handles;        /* 1: MPI handles are ints (MPICH ABI); 0: pointers */
    void *in_place;         /* MPI_IN_PLACE */
    fn_t fn[FN_COUNT];
    PyTypeObject *datatype; /* mpi4py.MPI.Datatype */
    PyTypeObject *op;       /* mpi4py.MPI.Op */
    PyObject *error;        /* mpi4py.MPI.Exception */
    void *(*datatype_get)(PyObject *); /* mpi4py's PyMPIDatatype_Get: the MPI_Datatype inside a Datatype */
    void *(*op_get)(PyObject *);       /* mpi4py's PyMPIOp_Get: the MPI_Op inside an Op */
} S;

typedef Py_intptr_t H; /* a handle of either ABI, widened */

/* Each MPI call, once per handle ABI: T is the C type of MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request. */
#define CALLS(SUF, T)                                                                                      \
    /* status: where the MPI_Status goes (NULL: a local one, ignored) */                                 \
    static int test_##SUF(H *req, int *flag, void *status) {                                               \
        T r = (T)*req;                                                                                     \
        char ignored[256]; /* larger than any MPI_Status; avoids the ABI's MPI_STATUS_IGNORE */            \
        int rc = ((int (*)(T *, int *, void *))S.fn[FN_TEST])(&r, flag, status ? status : ignored);         \
        *req = (H)r;                                                                                       \
        return rc;                                                                                         \
    }                                                                                                      \
    /* allreduce and reduce_scatter_block: same signature */                                             \
    static int reduction_##SUF(int f, void *s, void *r, int n, H dt, H op, H comm, H *req) {               \
        T q;                                                                                               \
        int rc = ((int (*)(const void *, void *, int, T, T, T, T *))S.fn[f])(s, r, n, (T)dt, (T)op, (T)comm, &q); \
        *req = (H)q;                                                                                       \
        return rc;                                                                                         \
    }                                                                                                      \
    static int reduce_##SUF(void *s, void *r, int n, H dt, H op, int root, H comm, H *req) {               \
        T q;                                                                                               \
        int rc = ((int (*)(const void *, void *, int, T, T, int, T, T *))S.fn[FN_IREDUCE])(                 \
            s, r, n, (T)dt, (T)op, root, (T)comm, &q);                                                     \
        *req = (H)q;                                                                                       \
        return rc;                                                                                         \
    }                                                                                                      \
    static int bcast_##SUF(void *b, int n, H dt, int root, H comm, H *req) {                               \
        T q;                                                                                               \
        int rc = ((int (*)(void *, int, T, int, T, T *))S.fn[FN_IBCAST])(b, n, (T)dt, root, (T)comm, &q);   \
        *req = (H)q;                                                                                       \
        return rc;                                                                                         \
    }                                                                                                      \
    static int barrier_##SUF(H comm, H *req) {                                                             \
        T q;                                                                                               \
        int rc = ((int (*)(T, T *))S.fn[FN_IBARRIER])((T)comm, &q);                                        \
        *req = (H)q;                                                                                       \
        return rc;                                                                                         \
    }                                                                                                      \
    /* allgather and alltoall: same signature */                                                          \
    static int exchange_##SUF(int f, void *s, int sn, void *r, int rn, H dt, H comm, H *req) {             \
        T q;                                                                                               \
        int rc = ((int (*)(const void *, int, T, void *, int, T, T, T *))S.fn[f])(                         \
            s, sn, (T)dt, r, rn, (T)dt, (T)comm, &q);                                                      \
        *req = (H)q;                                                                                       \
        return rc;                                                                                         \
    }

CALLS(i, int)
CALLS(p, void *)

#define CALL(name, ...) (S.int_handles ? name##_i(__VA_ARGS__) : name##_p(__VA_ARGS__))

/* -- the Direct type: one communicator's calls ----------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    H comm;
    int rank, size;
    PyObject *fallback;
    PyObject *scratch; /* the blocking recv's buffer for small messages (_direct_p2p.c), or NULL */
} Direct;

/* the handle of an mpi4py object of type `type` (mpi4py.MPI.Datatype or Op), as `get` (mpi4py's
 * PyMPIDatatype_Get or PyMPIOp_Get) gives it; 0 if `o` is not one */
static int handle_of(PyObject *o, PyTypeObject *type, void *(*get)(PyObject *), H *h) {
    if (!PyObject_TypeCheck(o, type)) return 0;
    void *p = get(o); /* a pointer to the MPI_Datatype/MPI_Op: an int or a pointer, as bind said */
    if (p == NULL) {  /* only on a type mismatch, excluded above */
        PyErr_Clear();
        return 0;
    }
    *h = S.int_handles ? (H)(*(int *)p) : (H)(*(void **)p);
    return 1;
}

#define DATATYPE(o, h) handle_of(o, S.datatype, S.datatype_get, h)
#define OP(o, h) handle_of(o, S.op, S.op_get, h)

/* a C-contiguous numpy array whose element count fits an int: its data and count */
static int array_of(PyObject *o, int writeable, void **data, int *count) {
    if (!PyArray_Check(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    if (!PyArray_IS_C_CONTIGUOUS(a) || (writeable && !PyArray_ISWRITEABLE(a))) return 0;
    /* the element count, inline (PyArray_SIZE is a call through numpy's API table: a few ns per call) */
    int nd = PyArray_NDIM(a);
    npy_intp *dims = PyArray_DIMS(a), n = 1;
    for (int i = 0; i < nd; i++) {
        npy_intp d = dims[i];
        if (d == 0) {
            n = 0;
            break;
        }
        if (d > INT_MAX / n) return 0; /* past an int count (MPI-4's large-count calls: through mpi4py) */
        n *= d;
    }
    *data = PyArray_DATA(a);
    *count = (int)n;
    return 1;
}

static int small_int(PyObject *o, int *v) {
    if (!PyLong_CheckExact(o)) return 0;
    long x = PyLong_AsLong(o);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (x < INT_MIN || x > INT_MAX) return 0;
    *v = (int)x;
    return 1;
}

static PyObject *fallback(Direct *self, const char *name, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *method = PyObject_GetAttrString(self->fallback, name);
    if (method == NULL) return NULL;
    PyObject *result = PyObject_Vectorcall(method, args, nargs, NULL);
    Py_DECREF(method);
    return result;
}

/* after the MPI call was made with the GIL released: raise, or return None (complete) / the pending request */
static PyObject *finish(int rc, int done, H req) {
    if (rc != 0) {
        PyObject *code = PyLong_FromLong(rc);
        if (code != NULL) {
            PyErr_SetObject(S.error, code);
            Py_DECREF(code);
        }
        return NULL;
    }
    if (done) Py_RETURN_NONE;
    return PyLong_FromSize_t((size_t)req); /* as mpi4py shows handles: the unsigned pointer-width value */
}

/* How long (ns) the tests go on with a yield of the CPU between them, after the spins, where `spins` < 0 (more
 * ranks than cores); the clock is read every YIELD_BATCH tests. Measured with the MPICH wheel on 2 cores, 8-byte
 * all_reduce over raw MPI's blocking call (one launch each): 1 ms, 16 ranks 1.40x, 32 ranks 2.21x; 10 ms, 1.30x
 * and 1.28x. The rank hands back to Python, which tests from there on, after this long: its timeout, its stall
 * beats and Ctrl-C are at most this late. */
#define YIELDING_NS 10000000LL
#define YIELD_BATCH 16

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* test `req` up to `spins` times (GIL released); `status` (NULL: ignored) gets the completed one's MPI_Status.
 * A negative `spins` (a node with more ranks than cores) tests -spins times flat out, then up to
 * YIELDING_TESTS times with sched_yield() between: the ranks waited for get the core at once, and a
 * test costs no Python. It stays bounded (a few ms at most), so the caller's timeout still holds. */
static int spin(H *req, int spins, int *done, void *status) {
    int rc = 0, yielding = spins < 0;
    *done = 0;
    if (yielding) spins = -spins;
    while (spins-- > 0 && !*done) {
        rc = CALL(test, req, done, status);
        if (rc != 0) return rc;
    }
    if (!yielding || *done) return rc;
    long long end = now_ns() + YIELDING_NS;
    for (;;) {
        for (int k = 0; k < YIELD_BATCH; k++) {
            sched_yield();
            rc = CALL(test, req, done, status);
            if (rc != 0 || *done) return rc;
        }
        if (now_ns() > end) return rc;
    }
}

#define RUN(call)                       \
    int rc, done = 0;                   \
    H req = 0;                          \
    Py_BEGIN_ALLOW_THREADS              \
    rc = call;                          \
    if (rc == 0) rc = spin(&req, spins, &done, NULL); \
    Py_END_ALLOW_THREADS                \
    return finish(rc, done, req);

/* allreduce(buf, datatype, op, spins): in place */
static PyObject *direct_allreduce(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, spins;
    H dt, op;
    if (nargs != 4 || !array_of(args[0], 1, &b, &n) || !DATATYPE(args[1], &dt) ||
        !OP(args[2], &op) || !small_int(args[3], &spins))
        return fallback(self, "allreduce", args, nargs);
    RUN(CALL(reduction, FN_IALLREDUCE, S.in_place, b, n, dt, op, self->comm, &req))
}

/* reduce(buf, datatype, op, root, spins): in place at the root, send only elsewhere */
static PyObject *direct_reduce(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, root, spins;
    H dt, op;
    if (nargs != 5 || !DATATYPE(args[1], &dt) || !OP(args[2], &op) ||
        !small_int(args[3], &root) || !small_int(args[4], &spins))
        return fallback(self, "reduce", args, nargs);
    int at_root = root == self->rank;
    if (!array_of(args[0], at_root, &b, &n)) return fallback(self, "reduce", args, nargs);
    void *s = at_root ? S.in_place : b, *r = at_root ? b : NULL;
    RUN(CALL(reduce, s, r, n, dt, op, root, self->comm, &req))
}

/* bcast(buf, datatype, root, spins) */
static PyObject *direct_bcast(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, root, spins;
    H dt;
    if (nargs != 4 || !array_of(args[0], 0, &b, &n) || !DATATYPE(args[1], &dt) ||
        !small_int(args[2], &root) || !small_int(args[3], &spins))
        return fallback(self, "bcast", args, nargs);
    RUN(CALL(bcast, b, n, dt, root, self->comm, &req))
}

/* barrier(spins) */
static PyObject *direct_barrier(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    int spins;
    if (nargs != 1 || !small_int(args[0], &spins)) return fallback(self, "barrier", args, nargs);
    RUN(CALL(barrier, self->comm, &req))
}

/* allgather(out, inp or None for in place, datatype, spins): `out` holds size blocks of inp's count */
static PyObject *direct_allgather(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *o, *i;
    int on, in, spins;
    H dt;
    if (nargs != 4 || !array_of(args[0], 1, &o, &on) || !DATATYPE(args[2], &dt) ||
        !small_int(args[3], &spins))
        return fallback(self, "allgather", args, nargs);
    if (args[1] == Py_None) {
        i = S.in_place;
        in = 0;
    } else if (!array_of(args[1], 0, &i, &in)) {
        return fallback(self, "allgather", args, nargs);
    }
    int block = on / self->size;
    RUN(CALL(exchange, FN_IALLGATHER, i, in, o, block, dt, self->comm, &req))
}

/* alltoall(out, inp, datatype, spins): equal blocks */
static PyObject *direct_alltoall(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *o, *i;
    int on, in, spins;
    H dt;
    if (nargs != 4 || !array_of(args[0], 1, &o, &on) || !array_of(args[1], 0, &i, &in) ||
        !DATATYPE(args[2], &dt) || !small_int(args[3], &spins))
        return fallback(self, "alltoall", args, nargs);
    int sblock = in / self->size, rblock = on / self->size;
    RUN(CALL(exchange, FN_IALLTOALL, i, sblock, o, rblock, dt, self->comm, &req))
}

/* reduce_scatter_block(out, inp, datatype, op, spins) */
static PyObject *direct_reduce_scatter_block(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *o, *i;
    int on, in, spins;
    H dt, op;
    if (nargs != 5 || !array_of(args[0], 1, &o, &on) || !array_of(args[1], 0, &i, &in) ||
        !DATATYPE(args[2], &dt) || !OP(args[3], &op) || !small_int(args[4], &spins))
        return fallback(self, "reduce_scatter_block", args, nargs);
    RUN(CALL(reduction, FN_IRSB, i, o, on, dt, op, self->comm, &req))
}

/* reduce_scatter(out, inp, datatype, op, spins), the vector call: always through mpi4py. MPI reads its
 * counts array until the operation completes, and mpi4py keeps that array alive with the request; the
 * call serves large inputs only (MPIBackend.reduce_scatter_tensor), where mpi4py's cost does not show. */
static PyObject *direct_reduce_scatter(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    return fallback(self, "reduce_scatter", args, nargs);
}

/* point-to-point (send, recv, irecv): a section of its own */
#include "_direct_p2p.c"
#include "_direct_posted.c"

static int direct_init(Direct *self, PyObject *args, PyObject *kwds) {
    PyObject *comm, *fb;
    int rank, size;
    static char *kw[] = {"comm", "rank", "size", "fallback", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiiO:Direct", kw, &comm, &rank, &size, &fb)) return -1;
    if (!S.bound) {
        PyErr_SetString(PyExc_RuntimeError, "Direct: bind() the MPI library first");
        return -1;
    }
    if (size < 1 || rank < 0 || rank >= size) {
        PyErr_SetString(PyExc_ValueError, "Direct: need 0 <= rank < size");
        return -1;
    }
    unsigned long long h = PyLong_AsUnsignedLongLongMask(comm);
    if (h == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    self->comm = (H)h;
    self->rank = rank;
    self->size = size;
    Py_INCREF(fb);
    Py_XSETREF(self->fallback, fb);
    return 0;
}

static void direct_dealloc(Direct *self) {
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->scratch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define M(name) {#name, (PyCFunction)(void (*)(void))direct_##name, METH_FASTCALL, NULL}
static PyMethodDef direct_methods[] = {M(allreduce), M(reduce), M(bcast), M(allgather), M(alltoall),
                                     M(reduce_scatter_block), M(reduce_scatter), M(barrier), P2P_METHODS,
                                     POSTED_METHODS, {NULL}};

static PyTypeObject DirectType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mpidist.backends._direct.Direct",
    .tp_basicsize = sizeof(Direct),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Direct(comm, rank, size, fallback): one communicator's hot collectives as direct MPI calls",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)direct_init,
    .tp_dealloc = (destructor)direct_dealloc,
    .tp_methods = direct_methods,
};

/* the C function `name` of mpi4py's C API from its capsule in `capi` (mpi4py.MPI.__pyx_capi__), checked
 * against its C signature, as mpi4py's include/mpi4py/pycapi.h imports it; NULL with OSError if absent */
static void *capi_function(PyObject *capi, const char *name, const char *signature) {
    PyObject *capsule = PyDict_GetItemString(capi, name); /* borrowed */
    if (capsule == NULL || !PyCapsule_IsValid(capsule, signature)) {
        PyErr_Format(PyExc_OSError, "bind: mpi4py's C API has no %s of signature %s", name, signature);
        return NULL;
    }
    return PyCapsule_GetPointer(capsule, signature);
}

/* bind(library, int_handles, in_place, Datatype, Op, Exception, capi): find the MPI functions in
 * `library` (a path: mpi4py's MPI extension module, whose dependencies include libmpi) and mpi4py's
 * handle getters in `capi` (mpi4py.MPI.__pyx_capi__). Returns None, or raises OSError naming the
 * function it could not find. */
static PyObject *bind(PyObject *mod, PyObject *args) {
    const char *library;
    int int_handles;
    unsigned long long in_place;
    PyObject *datatype, *op, *error, *capi;
    if (!PyArg_ParseTuple(args, "spKO!O!OO!:bind", &library, &int_handles, &in_place, &PyType_Type, &datatype,
                          &PyType_Type, &op, &error, &PyDict_Type, &capi))
        return NULL;
    void *datatype_get = capi_function(capi, "PyMPIDatatype_Get", "MPI_Datatype *(PyObject *)");
    void *op_get = datatype_get ? capi_function(capi, "PyMPIOp_Get", "MPI_Op *(PyObject *)") : NULL;
    if (op_get == NULL) return NULL;
    void *lib = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "bind: %s is not loaded", library);
    fn_t fn[FN_COUNT];
    for (int k = 0; k < FN_COUNT; k++) {
        fn[k] = dlsym(lib, NAMES[k]);
        if (fn[k] == NULL) return PyErr_Format(PyExc_OSError, "bind: %s not found from %s", NAMES[k], library);
    }
    memcpy(S.fn, fn, sizeof fn);
    S.int_handles = int_handles;
    S.in_place = (void *)(uintptr_t)in_place;
    S.datatype_get = (void *(*)(PyObject *))datatype_get;
    S.op_get = (void *(*)(PyObject *))op_get;
    Py_INCREF(datatype);
    Py_INCREF(op);
    Py_INCREF(error);
    Py_XSETREF(S.datatype, (PyTypeObject *)datatype);
    Py_XSETREF(S.op, (PyTypeObject *)op);
    Py_XSETREF(S.error, error);
    S.bound = 1;
    Py_RETURN_NONE;
}

/* handle(obj): the handle of an mpi4py Datatype or Op as the calls read it (direct.py checks it) */
static PyObject *handle(PyObject *mod, PyObject *o) {
    H h;
    if (!S.bound) {
        PyErr_SetString(PyExc_RuntimeError, "handle: bind() the MPI library first");
        return NULL;
    }
    if (!DATATYPE(o, &h) && !OP(o, &h)) {
        PyErr_SetString(PyExc_TypeError, "handle: obj is neither an mpi4py.MPI.Datatype nor an mpi4py.MPI.Op");
        return NULL;
    }
    return PyLong_FromSize_t((size_t)h);
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, "bind(library, int_handles, in_place, Datatype, Op, Exception, capi)"},
    P2P_MODULE_METHODS,
    {"handle", handle, METH_O, "handle(obj): the MPI handle of an mpi4py Datatype or Op, as the calls read it"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_direct", "Direct MPI calls of the MPI backend's hot collectives.",
                                    -1, module_methods};

PyMODINIT_FUNC PyInit__direct(void) {
    import_array(); /* numpy's C API (returns NULL if numpy cannot be imported) */
    if (PyType_Ready(&DirectType) < 0 || PyType_Ready(&PostedType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED); /* free-threaded Python: S and the calls assume the GIL */
#endif
    Py_INCREF(&DirectType);
    if (PyModule_AddObject(m, "Direct", (PyObject *)&DirectType) < 0) {
        Py_DECREF(&DirectType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PostedType);
    if (PyModule_AddObject(m, "Posted", (PyObject *)&PostedType) < 0) {
        Py_DECREF(&PostedType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
