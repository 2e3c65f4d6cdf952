/* mpidist.backends._direct, the Work of an isend/irecv posted from C: `Posted`.
 *
 * #included by _direct.c after _direct_p2p.c (it uses their handles, P, `spin`, `raise_mpi` and the Direct type).
 * A Python Work costs a few Python calls to make and to wait for (about 1 us a side at 8 bytes, where a
 * message takes 1-2 us), so the common isend/irecv (a C-contiguous numpy array, a known peer, the group's
 * timeout) returns this object instead. In C it does what the common case needs:
 *
 *   wait()           up to `spins` tests as `spin` does (GIL released); complete and, for a receive, exactly the
 *                    array's bytes with no error in the status: True. `wait(None)` is the same.
 *   is_completed()   one test, the same outcome.
 *   with_outputs(l)  itself where `l` is [its own array] (batch_isend_irecv names the caller's arrays).
 *
 * Everything else (a wait still pending after the spins, a timeout argument, a message of another size, an
 * MPI error, any other attribute such as `get_future`, `source_rank`, `exception`) first *promotes* it: the
 * owner (the MPIBackend) builds the Python Work the call would have returned (`owner.promoted(...)`, from the
 * request handle, or the completed status), and the call goes to that Work; so does every later one. A
 * Posted dropped while pending hands its request and array to `owner.abandoned(handle, buf)`, which keeps
 * the array referenced until MPI is done with it, as a dropped Work does.
 *
 * Direct's methods (None where an argument is not taken: the caller takes the Python path):
 *   post_send(buf, datatype, peer, tag, spins, owner, seq)   MPI_Isend of buf (count elements of datatype)
 *   post_recv(buf, peer, tag, spins, owner, seq)             MPI_Irecv of buf's bytes from `peer` (an MPI rank or
 *                                                            MPI_ANY_SOURCE), as direct_irecv posts it
 * The posting call keeps the GIL (MPI_Isend/MPI_Irecv return at once). An MPI error raises mpi4py.MPI.Exception.
 */

enum { POSTED_PENDING, POSTED_DONE, POSTED_PROMOTED };

typedef struct {
    PyObject_HEAD
    H req;
    int state;      /* POSTED_*: pending, complete (its result right), or promoted (`full` answers) */
    int nbytes;     /* a receive: the array's bytes, checked on completion; -1: a send */
    int peer;       /* a receive: the source as posted (an MPI rank, or MPI_ANY_SOURCE) */
    int spins;      /* the owner's c_spins */
    long long seq;  /* the owner's number of this call (errors name it) */
    PyObject *buf;  /* the array: MPI's while pending, then the output (result(), the Future's value) */
    PyObject *owner;
    PyObject *full; /* the Python Work this became, once promoted */
    char status[256]; /* a receive's MPI_Status (larger than any library's) */
} Posted;

static PyTypeObject PostedType;

static PyObject *posted_make(PyObject *buf, PyObject *owner, long long seq, int nbytes, int peer, int spins, H req) {
    Posted *p = PyObject_GC_New(Posted, &PostedType);
    if (p == NULL) return NULL;
    p->req = req;
    p->state = POSTED_PENDING;
    p->nbytes = nbytes;
    p->peer = peer;
    p->spins = spins;
    p->seq = seq;
    Py_INCREF(buf);
    p->buf = buf;
    Py_INCREF(owner);
    p->owner = owner;
    p->full = NULL;
    *(int *)(p->status + P.error_at) = 0; /* what a completed receive's status holds unless the library sets it */
    PyObject_GC_Track((PyObject *)p);
    return (PyObject *)p;
}

/* post_send(buf, datatype, peer, tag, spins, owner, seq) */
static PyObject *direct_post_send(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, peer, tag, spins;
    H dt, req = 0;
    if (!P.bound || nargs != 7 || !array_of(args[0], 0, &b, &n) || !DATATYPE(args[1], &dt) ||
        !small_int(args[2], &peer) || !small_int(args[3], &tag) || !small_int(args[4], &spins) ||
        !PyLong_CheckExact(args[6]))
        Py_RETURN_NONE;
    long long seq = PyLong_AsLongLong(args[6]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int rc = CALL(isend, b, n, dt, peer, tag, self->comm, &req);
    if (rc != 0) return raise_mpi(rc);
    return posted_make(args[0], args[5], seq, -1, peer, spins, req);
}

/* post_recv(buf, peer, tag, spins, owner, seq) */
static PyObject *direct_post_recv(Direct *self, PyObject *const *args, Py_ssize_t nargs) {
    void *b;
    int n, peer, tag, spins;
    H req = 0;
    if (!P.bound || nargs != 6 || !bytes_of(args[0], 1, &b, &n) || !small_int(args[1], &peer) ||
        !small_int(args[2], &tag) || !small_int(args[3], &spins) || !PyLong_CheckExact(args[5]))
        Py_RETURN_NONE;
    long long seq = PyLong_AsLongLong(args[5]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int rc = CALL(irecv, b, n, peer, tag, self->comm, &req);
    if (rc != 0) return raise_mpi(rc);
    return posted_make(args[0], args[4], seq, n, peer, spins, req);
}

#define POSTED_METHODS M(post_send), M(post_recv)

/* a completed request's result is what the caller asked for: any send; a receive of exactly its bytes */
static int posted_right(Posted *self) {
    return self->nbytes < 0 || received_exactly(self->status, self->nbytes);
}

/* hand over to the Python Work (see the top); `rc` and `done` are the last test's. 0, or -1 with an error */
static int posted_promote(Posted *self, int rc, int done) {
    if (self->state == POSTED_PROMOTED) return 0;
    int ended = self->state == POSTED_DONE || done || rc != 0; /* MPI has freed the request */
    PyObject *handle, *status, *buf = self->buf ? self->buf : Py_None;
    if (ended) {
        handle = Py_None;
        Py_INCREF(handle);
    } else {
        handle = PyLong_FromSize_t((size_t)self->req);
    }
    if (ended && self->nbytes >= 0) {
        status = PyBytes_FromStringAndSize(self->status, sizeof self->status);
    } else {
        status = Py_None;
        Py_INCREF(status);
    }
    Py_INCREF(buf);
    PyObject *full = NULL;
    if (handle != NULL && status != NULL)
        full = PyObject_CallMethod(self->owner, "promoted", "OOLiOiO", self->nbytes >= 0 ? Py_True : Py_False, buf,
                                   self->seq, self->peer, handle, rc, status);
    Py_XDECREF(handle);
    Py_XDECREF(status);
    Py_DECREF(buf);
    if (full == NULL) return -1;
    self->full = full;
    self->state = POSTED_PROMOTED;
    Py_CLEAR(self->buf); /* the Work holds it now */
    return 0;
}

static PyObject *posted_forward(Posted *self, const char *name, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    PyObject *method = PyObject_GetAttrString(self->full, name);
    if (method == NULL) return NULL;
    PyObject *result = PyObject_Vectorcall(method, args, nargs, kwnames);
    Py_DECREF(method);
    return result;
}

/* wait(timeout=None) */
static PyObject *posted_wait(Posted *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (self->state == POSTED_DONE) Py_RETURN_TRUE;
    int plain = kwnames == NULL && (nargs == 0 || (nargs == 1 && args[0] == Py_None));
    if (self->state == POSTED_PENDING) {
        int rc = 0, done = 0;
        if (plain) {
            H req = self->req;
            void *status = self->nbytes >= 0 ? self->status : NULL;
            Py_BEGIN_ALLOW_THREADS
            rc = spin(&req, self->spins, &done, status);
            Py_END_ALLOW_THREADS
            self->req = req;
            if (rc == 0 && done && posted_right(self)) {
                self->state = POSTED_DONE;
                Py_RETURN_TRUE;
            }
        }
        if (posted_promote(self, rc, done) < 0) return NULL;
    }
    return posted_forward(self, "wait", args, nargs, kwnames);
}

/* is_completed() */
static PyObject *posted_is_completed(Posted *self, PyObject *unused) {
    if (self->state == POSTED_DONE) Py_RETURN_TRUE;
    if (self->state == POSTED_PENDING) {
        int done = 0;
        int rc = spin(&self->req, 1, &done, self->nbytes >= 0 ? self->status : NULL);
        if (rc == 0 && !done) Py_RETURN_FALSE;
        if (rc == 0 && posted_right(self)) {
            self->state = POSTED_DONE;
            Py_RETURN_TRUE;
        }
        if (posted_promote(self, rc, done) < 0) return NULL;
    }
    return posted_forward(self, "is_completed", NULL, 0, NULL);
}

/* with_outputs(outputs): the outputs are its own array already (isend/irecv of a numpy array) or the Python
 * Work takes them */
static PyObject *posted_with_outputs(Posted *self, PyObject *outputs) {
    if (self->state != POSTED_PROMOTED && PyList_CheckExact(outputs) && PyList_GET_SIZE(outputs) == 1 &&
        PyList_GET_ITEM(outputs, 0) == self->buf) {
        Py_INCREF(self);
        return (PyObject *)self;
    }
    if (posted_promote(self, 0, 0) < 0) return NULL;
    PyObject *args[1] = {outputs};
    return posted_forward(self, "with_outputs", args, 1, NULL);
}

/* any other attribute: the Python Work's (promoting first) */
static PyObject *posted_getattro(Posted *self, PyObject *name) {
    PyObject *found = PyObject_GenericGetAttr((PyObject *)self, name);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
    if (PyUnicode_Check(name) && PyUnicode_GetLength(name) > 1 && PyUnicode_READ_CHAR(name, 0) == '_' &&
        PyUnicode_READ_CHAR(name, 1) == '_')
        return NULL; /* dunder lookups (copy, pickle, ...) do not promote */
    PyErr_Clear();
    if (posted_promote(self, 0, 0) < 0) return NULL;
    return PyObject_GetAttr(self->full, name);
}

static PyObject *posted_repr(Posted *self) {
    if (self->state == POSTED_PROMOTED) return PyObject_Repr(self->full);
    return PyUnicode_FromFormat("<mpidist.Work %s #%lld %s>", self->nbytes >= 0 ? "recv" : "send", self->seq,
                                self->state == POSTED_DONE ? "done" : "pending");
}

/* dropped while pending: the owner keeps the array until MPI is done with it */
static void posted_finalize(Posted *self) {
    if (self->state != POSTED_PENDING || self->owner == NULL) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *handle = PyLong_FromSize_t((size_t)self->req);
    PyObject *r = handle ? PyObject_CallMethod(self->owner, "abandoned", "OO", handle, self->buf ? self->buf : Py_None)
                         : NULL;
    Py_XDECREF(handle);
    if (r == NULL)
        PyErr_Clear(); /* interpreter shutdown: nothing left to protect */
    else
        Py_DECREF(r);
    self->state = POSTED_DONE; /* handed over: a second finalize does nothing (and no call promotes it) */
    PyErr_Restore(type, value, tb);
}

static int posted_traverse(Posted *self, visitproc visit, void *arg) {
    Py_VISIT(self->buf);
    Py_VISIT(self->owner);
    Py_VISIT(self->full);
    return 0;
}

static int posted_clear(Posted *self) {
    Py_CLEAR(self->buf);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->full);
    return 0;
}

static void posted_dealloc(Posted *self) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    posted_clear(self);
    PyObject_GC_Del(self);
}

static PyMethodDef posted_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))posted_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None): block until complete; True (Work.wait)"},
    {"is_completed", (PyCFunction)posted_is_completed, METH_NOARGS, "is_completed(): one test (Work.is_completed)"},
    {"with_outputs", (PyCFunction)posted_with_outputs, METH_O, "with_outputs(outputs): Work.with_outputs"},
    {NULL}};

static PyTypeObject PostedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mpidist.backends._direct.Posted",
    .tp_basicsize = sizeof(Posted),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The Work of an isend/irecv posted from C (see mpidist.Work)",
    .tp_dealloc = (destructor)posted_dealloc,
    .tp_finalize = (destructor)posted_finalize,
    .tp_traverse = (traverseproc)posted_traverse,
    .tp_clear = (inquiry)posted_clear,
    .tp_getattro = (getattrofunc)posted_getattro,
    .tp_repr = (reprfunc)posted_repr,
    .tp_methods = posted_methods,
};
