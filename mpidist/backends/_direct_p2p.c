/* mpidist.backends._direct, point-to-point: send, the blocking recv and the posted irecv as one C call each.
 *
 * #included by _direct.c (it uses that file's handles, Direct type, argument readers, `finish`, `spin` and
 * RUN); the MPI functions here are bound by `bind_p2p`, after `bind`. MPIBackend's point-to-point (mpi.py,
 * mpi_receive.py) calls these; where a call returns what the fallback returns, mpidist's Python paths run.
 *
 * send(buf, datatype, peer, tag, spins)   MPI_Isend, tested `spins` times: None (complete) or the request
 *                                          handle (an int), as the collectives.
 * irecv(buf, peer, tag)                    MPI_Irecv of the array's bytes (as mpi_receive.posted_receive
 *                                          posts it): the request handle.
 * recv(buf, peer, tag, spins)              the blocking recv, which must never write a message of another
 *                                          size into `buf` (docs/sharp-bits.md). Two routes, by size:
 *   - small (at most scratch_max bytes, bind_p2p's): MPI_Irecv into this communicator's scratch buffer of SCRATCH_CAP
 *     bytes, tested `spins` times; a message of exactly buf's size is copied into buf (a few ns at these
 *     sizes; counted: scratch_copies()), any other leaves buf untouched, and the size check is MPI_Get_count on the status (a
 *     message longer than the scratch buffer ends with MPI_ERR_TRUNCATE). No probe: MPI matches the
 *     message on arrival, as for raw Irecv.
 *   - large: MPI_Improbe up to `spins` times; a message of buf's size is received into buf (MPI_Imrecv,
 *     tested `spins` times); the probe costs nothing next to moving the message, and copying through a
 *     scratch buffer would.
 *   It returns
 *     an int                 complete: buf holds the message, and this is its source (group rank);
 *     None                   no message matched within the spins and nothing is posted (the Python
 *                            matched receive continues: MPIBackend.recv_and_wait);
 *     (handle, scratch)      small: the scratch receive is pending; `scratch` (a uint8 array) is the
 *                            caller's now, to copy from once complete;
 *     (handle,)              large: the receive into buf is pending (its size matched);
 *     (source, nbytes)       small: complete, but nbytes arrived (-1: more than the scratch buffer
 *                            holds); buf untouched;
 *     (source, nbytes, msg)  large: a message of nbytes matched (an MPI_Message handle), not received.
 * wait(request, status, spins[, nbytes])  the first test of a Work's wait (work.py, mpi_receive.py): tests the
 *                                          mpi4py Request `request` up to `spins` times as `spin` does (GIL
 *                                          released), in place, as its own Test would (the handle becomes
 *                                          MPI_REQUEST_NULL on completion); `status` (an mpi4py Status, or
 *                                          None) gets the completed one's MPI_Status. True once complete, else
 *                                          False; an MPI error raises mpi4py.MPI.Exception, as Test does.
 *                                          With `nbytes` (a receive posted as bytes, and a status): True only
 *                                          if the message had exactly `nbytes` bytes and its status holds no
 *                                          error (Open MPI reports a longer message there); complete otherwise
 *                                          gives None, for the receive's own check in Python.
 */

static void *capi_function(PyObject *capi, const char *name, const char *signature); /* _direct.c */

/* the blocking recv's routes: through the scratch buffer up to P.scratch_max bytes (bind_p2p's argument:
 * 16 KiB, or 0 where a truncated receive is unsafe); the buffer holds more, so that a slightly longer
 * message still says its size */
#define SCRATCH_CAP 65536

static struct {
    int bound;
    fn_t isend, irecv, improbe, imrecv, get_count, error_class;
    H byte;           /* MPI_BYTE */
    int err_truncate; /* the error class MPI_ERR_TRUNCATE */
    int source_at;    /* the byte offset of MPI_SOURCE in an MPI_Status */
    int error_at;     /* the byte offset of MPI_ERROR in an MPI_Status */
    int scratch_max;  /* the largest blocking recv (bytes) through the scratch buffer */
    long long copies, copied_bytes; /* the small route's copies from the scratch buffer (scratch_copies()) */
    PyTypeObject *request, *status;      /* mpi4py.MPI.Request and Status */
    void *(*request_get)(PyObject *);    /* mpi4py's PyMPIRequest_Get: the MPI_Request inside a Request */
    void *(*status_get)(PyObject *);     /* mpi4py's PyMPIStatus_Get: the MPI_Status inside a Status */
} P;

/* Each call once per handle ABI (T: the C type of MPI handles, MPI_Message included) */
#define P2P_CALLS(SUF, T)                                                                                     \
    static int isend_##SUF(void *b, int n, H dt, int peer, int tag, H comm, H *req) {                         \
        T q;                                                                                                  \
        int rc = ((int (*)(const void *, int, T, int, int, T, T *))P.isend)(b, n, (T)dt, peer, tag, (T)comm, &q); \
        *req = (H)q;                                                                                          \
        return rc;                                                                                            \
    }                                                                                                         \
    static int irecv_##SUF(void *b, int nbytes, int peer, int tag, H comm, H *req) {                          \
        T q;                                                                                                  \
        int rc = ((int (*)(void *, int, T, int, int, T, T *))P.irecv)(b, nbytes, (T)P.byte, peer, tag, (T)comm, &q); \
        *req = (H)q;                                                                                          \
        return rc;                                                                                            \
    }                                                                                                         \
    static int improbe_##SUF(int peer, int tag, H comm, int *flag, H *msg, void *status) {                   \
        T m;                                                                                                  \
        int rc = ((int (*)(int, int, T, int *, T *, void *))P.improbe)(peer, tag, (T)comm, flag, &m, status); \
        *msg = (H)m;                                                                                          \
        return rc;                                                                                            \
    }                                                                                                         \
    static int imrecv_##SUF(void *b, int nbytes, H *msg, H *req) {                                            \
        T m = (T)*msg;                                                                                        \
        T q;                                                                                                  \
        int rc = ((int (*)(void *, int, T, T *, T *))P.imrecv)(b, nbytes, (T)P.byte, &m, &q);                 \
        *msg = (H)m;                                                                                          \
        *req = (H)q;                                                                                          \
        return rc;                                                                                            \
    }                                                                                                         \
    static int count_##SUF(const void *status, int *nbytes) {                                                 \
        return ((int (*)(const void *, T, int *))P.get_count)(status, (T)P.byte, nbytes);                    \
    }

P2P_CALLS(i, int)
P2P_CALLS(p, void *)

static int error_class(int rc) {
    int cls = rc;
    ((int (*)(int, int *))P.error_class)(rc, &cls);
    return cls;
}

/* a C-contiguous numpy array and its size in bytes, if that fits an int */
static int bytes_of(PyObject *o, int writeable, void **data, int *nbytes) {
    if (!PyArray_Check(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    if (!PyArray_IS_C_CONTIGUOUS(a) || (writeable && !PyArray_ISWRITEABLE(a))) return 0;
    npy_intp n = PyArray_NBYTES(a);
    if (n > INT_MAX) return 0;
    *data = PyArray_DATA(a);
    *nbytes = (int)n;
    return 1;
}

/* send(buf, datatype, peer, tag, spins) */
static PyObject *direct_send(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, peer, tag, spins;
    H dt;
    if (!P.bound || nargs != 5 || !array_of(args[0], 0, &b, &n) || !DATATYPE(args[1], &dt) ||
        !small_int(args[2], &peer) || !small_int(args[3], &tag) || !small_int(args[4], &spins))
        return fallback(self, "send", args, nargs);
    RUN(CALL(isend, b, n, dt, peer, tag, self->comm, &req))
}

/* irecv(buf, peer, tag) */
static PyObject *direct_irecv(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, peer, tag, spins = 0;
    if (!P.bound || nargs != 3 || !bytes_of(args[0], 1, &b, &n) || !small_int(args[1], &peer) ||
        !small_int(args[2], &tag))
        return fallback(self, "irecv", args, nargs);
    RUN(CALL(irecv, b, n, peer, tag, self->comm, &req))
}

static PyObject *raise_mpi(int rc) {
    return finish(rc, 0, 0);
}

/* the small route of recv: through the scratch buffer */
static PyObject *recv_small(Direct *self, void *b, int n, int peer, int tag, int spins) {
    PyObject *scratch = self->scratch; /* taken: another thread's call (the GIL is released below) makes its own */
    self->scratch = NULL;
    if (scratch == NULL) {
        npy_intp cap = SCRATCH_CAP;
        scratch = PyArray_SimpleNew(1, &cap, NPY_UINT8);
        if (scratch == NULL) return NULL;
    }
    void *s = PyArray_DATA((PyArrayObject *)scratch);
    char status[256];
    int rc, trc = 0, done = 0, got = -1;
    H req = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = CALL(irecv, s, SCRATCH_CAP, peer, tag, self->comm, &req);
    if (rc == 0) trc = spin(&req, spins, &done, status);
    if (done && trc == 0) CALL(count, status, &got);
    if (got >= SCRATCH_CAP) got = -1; /* the buffer is full: the message may be longer (Open MPI truncates silently) */
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        Py_DECREF(scratch);
        return raise_mpi(rc);
    }
    if (trc != 0) { /* the test failed: the request is complete (freed), with an error */
        Py_XSETREF(self->scratch, scratch);
        if (error_class(trc) != P.err_truncate) return raise_mpi(trc);
        done = 1;
        got = -1; /* longer than the scratch buffer */
    }
    if (!done) {
        PyObject *h = PyLong_FromSize_t((size_t)req);
        if (h == NULL) { /* the receive stays posted into scratch: keep it alive for good */
            return NULL;
        }
        PyObject *pending = PyTuple_Pack(2, h, scratch);
        Py_DECREF(h);
        Py_DECREF(scratch); /* the tuple holds it; so will the caller's Work */
        return pending;
    }
    int source = peer >= 0 ? peer : *(int *)(status + P.source_at);
    if (self->scratch == NULL) {
        self->scratch = scratch;
    } else {
        Py_DECREF(scratch);
        scratch = self->scratch;
    }
    if (got == n) {
        memcpy(b, PyArray_DATA((PyArrayObject *)scratch), (size_t)n);
        P.copies++; /* the GIL is held here */
        P.copied_bytes += n;
        return PyLong_FromLong(source);
    }
    return Py_BuildValue("(ii)", source, got);
}

/* the large route of recv: probe, then receive into buf */
static PyObject *recv_large(Direct *self, void *b, int n, int peer, int tag, int spins) {
    char status[256];
    int rc = 0, flag = 0, got = -1, done = 0;
    H msg = 0, req = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int k = 0; k < spins && !flag && rc == 0; k++) rc = CALL(improbe, peer, tag, self->comm, &flag, &msg, status);
    if (rc == 0 && flag) {
        rc = CALL(count, status, &got);
        if (rc == 0 && got == n) {
            rc = CALL(imrecv, b, n, &msg, &req);
            if (rc == 0) rc = spin(&req, spins, &done, NULL);
        }
    }
    Py_END_ALLOW_THREADS
    if (rc != 0) return raise_mpi(rc);
    if (!flag) Py_RETURN_NONE;
    int source = *(int *)(status + P.source_at);
    if (got != n) return Py_BuildValue("(iiN)", source, got, PyLong_FromSize_t((size_t)msg));
    if (!done) return Py_BuildValue("(N)", PyLong_FromSize_t((size_t)req));
    return PyLong_FromLong(source);
}

/* recv(buf, peer, tag, spins) */
static PyObject *direct_recv(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, peer, tag, spins;
    if (!P.bound || nargs != 4 || !bytes_of(args[0], 1, &b, &n) || !small_int(args[1], &peer) ||
        !small_int(args[2], &tag) || !small_int(args[3], &spins))
        return fallback(self, "recv", args, nargs);
    if (n <= P.scratch_max) return recv_small(self, b, n, peer, tag, spins);
    return recv_large(self, b, n, peer, tag, spins);
}

/* whether the completed receive whose MPI_Status is `status` brought exactly `nbytes` bytes, with no error in
 * the status (Open MPI reports a longer message there) */
static int received_exactly(const void *status, int nbytes) {
    int got = -1;
    return *(const int *)((const char *)status + P.error_at) == 0 && CALL(count, status, &got) == 0 && got == nbytes;
}

/* wait(request, status, spins[, nbytes]) */
static PyObject *direct_wait(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    int spins, nbytes = -1;
    if (!P.bound || nargs < 3 || nargs > 4 || !PyObject_TypeCheck(args[0], P.request) ||
        (args[1] != Py_None && !PyObject_TypeCheck(args[1], P.status)) || !small_int(args[2], &spins) ||
        (nargs == 4 && (args[1] == Py_None || !small_int(args[3], &nbytes))))
        return fallback(self, "wait", args, nargs);
    void *q = P.request_get(args[0]); /* the MPI_Request inside the object: tested in place */
    void *status = args[1] == Py_None ? NULL : P.status_get(args[1]);
    if (q == NULL || (args[1] != Py_None && status == NULL)) return NULL; /* excluded by the type checks */
    H req = S.int_handles ? (H)(*(int *)q) : (H)(*(void **)q);
    int rc, done = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = spin(&req, spins, &done, status);
    Py_END_ALLOW_THREADS
    if (S.int_handles)
        *(int *)q = (int)req;
    else
        *(void **)q = (void *)req;
    if (rc != 0) return raise_mpi(rc);
    if (done && nbytes >= 0 && !received_exactly(status, nbytes)) Py_RETURN_NONE; /* the size check (see the top) */
    return PyBool_FromLong(done);
}

#define P2P_METHODS M(send), M(irecv), M(recv), M(wait)

/* bind_p2p(library, byte, err_truncate, source_at, error_at, scratch_max, Request, Status, capi): find the
 * point-to-point functions in `library` (after bind); `byte` is mpi4py.MPI.BYTE; `source_at` and `error_at`
 * the byte offsets of MPI_SOURCE and MPI_ERROR in an MPI_Status (direct.py finds them with mpi4py's
 * Status.Set_source and Set_error); `scratch_max` the
 * largest blocking recv (bytes) that takes the scratch route (0: none, every recv probes); `Request` and
 * `Status` are mpi4py's classes, whose C objects `wait` reads through the getters of `capi`
 * (mpi4py.MPI.__pyx_capi__). Returns None, or raises OSError naming what is missing. */
static PyObject *bind_p2p(PyObject *mod, PyObject *args) {
    const char *library;
    PyObject *byte, *request, *status, *capi;
    int err_truncate, source_at, error_at, scratch_max;
    if (!PyArg_ParseTuple(args, "sOiiiiO!O!O!:bind_p2p", &library, &byte, &err_truncate, &source_at, &error_at,
                          &scratch_max,
                          &PyType_Type, &request, &PyType_Type, &status, &PyDict_Type, &capi))
        return NULL;
    void *request_get = capi_function(capi, "PyMPIRequest_Get", "MPI_Request *(PyObject *)");
    void *status_get = request_get ? capi_function(capi, "PyMPIStatus_Get", "MPI_Status *(PyObject *)") : NULL;
    if (status_get == NULL) return NULL;
    if (scratch_max < 0 || scratch_max > SCRATCH_CAP / 2) {
        PyErr_SetString(PyExc_ValueError, "bind_p2p: scratch_max must be in 0..SCRATCH_CAP/2");
        return NULL;
    }
    if (!S.bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind_p2p: bind() the MPI library first");
        return NULL;
    }
    H bh;
    if (!DATATYPE(byte, &bh)) {
        PyErr_SetString(PyExc_TypeError, "bind_p2p: byte must be mpi4py.MPI.BYTE");
        return NULL;
    }
    if (source_at < 0 || source_at > 256 - (int)sizeof(int) || error_at < 0 || error_at > 256 - (int)sizeof(int)) {
        PyErr_SetString(PyExc_ValueError, "bind_p2p: source_at or error_at is outside an MPI_Status");
        return NULL;
    }
    void *lib = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "bind_p2p: %s is not loaded", library);
    static const char *names[] = {"MPI_Isend", "MPI_Irecv", "MPI_Improbe", "MPI_Imrecv", "MPI_Get_count",
                                  "MPI_Error_class"};
    fn_t fn[6];
    for (int k = 0; k < 6; k++) {
        fn[k] = dlsym(lib, names[k]);
        if (fn[k] == NULL) return PyErr_Format(PyExc_OSError, "bind_p2p: %s not found from %s", names[k], library);
    }
    P.isend = fn[0], P.irecv = fn[1], P.improbe = fn[2], P.imrecv = fn[3], P.get_count = fn[4];
    P.error_class = fn[5];
    P.byte = bh;
    P.err_truncate = err_truncate;
    P.source_at = source_at;
    P.error_at = error_at;
    P.scratch_max = scratch_max;
    P.request_get = (void *(*)(PyObject *))request_get;
    P.status_get = (void *(*)(PyObject *))status_get;
    Py_INCREF(request);
    Py_INCREF(status);
    Py_XSETREF(P.request, (PyTypeObject *)request);
    Py_XSETREF(P.status, (PyTypeObject *)status);
    P.bound = 1;
    Py_RETURN_NONE;
}

/* scratch_copies() -> (copies, bytes): the small recv route's copies from its scratch buffer into the arrays so
 * far, in this process (world.stats adds them to the staging copies it counts) */
static PyObject *scratch_copies(PyObject *module, PyObject *unused) {
    return Py_BuildValue("(LL)", P.copies, P.copied_bytes);
}

#define P2P_MODULE_METHODS \
    {"bind_p2p", bind_p2p, METH_VARARGS, "bind_p2p(library, byte, err_truncate, source_at, scratch_max, Request, Status, capi)"}, \
    {"scratch_copies", scratch_copies, METH_NOARGS, "scratch_copies() -> (copies, bytes) of the small recv route"}
