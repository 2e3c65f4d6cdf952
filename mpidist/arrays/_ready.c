/* mpidist.arrays._ready: the array layer's readiness and overlap checks in C.
 *
 * Every call on arrays starts with arrays/host.py's prepare_input, prepare_output,
 * prepare_inout or prepare_pair. Most arrays are ready as they are: an exact
 * numpy.ndarray, C-contiguous (and writeable, for outputs), of a dtype mpidist
 * supports. For those, the functions here answer without a Python frame:
 *
 *   prepare_input(x, ...)          -> x
 *   prepare_output(x, ...)         -> (x, None)
 *   prepare_inout(x, ...)          -> (x, None)
 *   prepare_pair(out, inp, ...)    -> (out, None, inp)
 *
 * and hand every other call, arguments unchanged, to the Python function of the
 * same name that `bind` gave (which checks again, then adapts, validates or stages).
 *
 * may_overlap(a, b) of two numpy arrays compares the byte ranges their elements
 * span (numpy's bounds check, as numpy.may_share_memory); anything else goes to
 * host.may_overlap. byte_spans(arrays) of a list or tuple of C-contiguous exact
 * numpy arrays gives host.byte_spans's answer (sorting the spans to decide whether
 * they are disjoint); anything else goes to host.byte_spans.
 *
 * The rules are host.py's; tests/test_arrays.py checks that both give the same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION /* the oldest numpy mpidist supports (pyproject.toml) */
#include <numpy/arrayobject.h>

enum { INPUT, OUTPUT, INOUT, PAIR, OVERLAP, SPANS, KINDS };

static struct {
    PyTypeObject *ndarray; /* numpy.ndarray */
    PyObject *dtypes;      /* arrays.dtypes.DTYPES: the supported dtypes (dict keys) */
    PyObject *slow[KINDS]; /* the Python functions */
} S;

/* 1 if `x` goes to MPI as it is; 0 if not (or before bind) */
static int ready(PyObject *x, int writeable) {
    if (S.ndarray == NULL || Py_TYPE(x) != S.ndarray) return 0;
    PyArrayObject_fields *a = (PyArrayObject_fields *)x;
    int need = NPY_ARRAY_C_CONTIGUOUS | (writeable ? NPY_ARRAY_WRITEABLE : 0);
    if ((a->flags & need) != need) return 0;
    int known = PyDict_Contains(S.dtypes, (PyObject *)a->descr);
    if (known < 0) {
        PyErr_Clear();
        return 0;
    }
    return known;
}

static PyObject *slow(int kind, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (S.slow[kind] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mpidist.arrays._ready: bind() was not called");
        return NULL;
    }
    return PyObject_Vectorcall(S.slow[kind], args, nargsf, kwnames);
}

static PyObject *prepare_input(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs >= 1 && ready(args[0], 0)) {
        Py_INCREF(args[0]);
        return args[0];
    }
    return slow(INPUT, args, (size_t)nargs, kwnames);
}

static PyObject *prepare_output(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs >= 1 && ready(args[0], 1)) return PyTuple_Pack(2, args[0], Py_None);
    return slow(OUTPUT, args, (size_t)nargs, kwnames);
}

static PyObject *prepare_inout(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs >= 1 && ready(args[0], 1)) return PyTuple_Pack(2, args[0], Py_None);
    return slow(INOUT, args, (size_t)nargs, kwnames);
}

static PyObject *prepare_pair(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs >= 2 && ready(args[0], 1) && ready(args[1], 0)) return PyTuple_Pack(3, args[0], Py_None, args[1]);
    return slow(PAIR, args, (size_t)nargs, kwnames);
}

/* the byte range [lo, hi) the elements of `a` span; 0 if it has none */
static int span(PyArrayObject *a, char **lo, char **hi) {
    char *low = PyArray_BYTES(a), *high = low;
    int nd = PyArray_NDIM(a);
    npy_intp *dims = PyArray_DIMS(a), *strides = PyArray_STRIDES(a);
    for (int i = 0; i < nd; i++) {
        if (dims[i] == 0) return 0;
        npy_intp reach = strides[i] * (dims[i] - 1);
        if (reach < 0)
            low += reach;
        else
            high += reach;
    }
    *lo = low;
    *hi = high + PyArray_ITEMSIZE(a);
    return 1;
}

static PyObject *may_overlap(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs == 2 && kwnames == NULL && PyArray_Check(args[0]) && PyArray_Check(args[1])) {
        char *alo, *ahi, *blo, *bhi;
        int both = span((PyArrayObject *)args[0], &alo, &ahi) && span((PyArrayObject *)args[1], &blo, &bhi);
        return PyBool_FromLong(both && alo < bhi && blo < ahi);
    }
    return slow(OVERLAP, args, (size_t)nargs, kwnames);
}

typedef struct {
    char *start, *end;
} Span;

static int by_start(const void *a, const void *b) {
    const Span *x = a, *y = b;
    return (x->start > y->start) - (x->start < y->start);
}

/* 1 if no two of the n spans share a byte (empty spans are left out beforehand) */
static int disjoint(Span *spans, Py_ssize_t n) {
    qsort(spans, (size_t)n, sizeof(Span), by_start);
    for (Py_ssize_t i = 1; i < n; i++)
        if (spans[i].start < spans[i - 1].end) return 0;
    return 1;
}

static PyObject *byte_spans(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || kwnames != NULL || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0])))
        return slow(SPANS, args, (size_t)nargs, kwnames);
    PyObject *seq = args[0];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != S.ndarray || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)items[i]))
            return slow(SPANS, args, (size_t)nargs, kwnames);
    }
    Span *spans = PyMem_Malloc(sizeof(Span) * (size_t)(n ? n : 1));
    PyObject *counts = PyList_New(n), *addrs = PyList_New(n);
    if (spans == NULL || counts == NULL || addrs == NULL) goto fail;
    char *lo = NULL, *hi = NULL;
    Py_ssize_t used = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyArrayObject *a = (PyArrayObject *)items[i];
        npy_intp bytes = PyArray_NBYTES(a);
        char *start = bytes ? PyArray_BYTES(a) : NULL;
        PyObject *count = PyLong_FromSsize_t(bytes), *addr = PyLong_FromSize_t((size_t)start);
        if (count == NULL || addr == NULL) {
            Py_XDECREF(count);
            Py_XDECREF(addr);
            goto fail;
        }
        PyList_SET_ITEM(counts, i, count);
        PyList_SET_ITEM(addrs, i, addr);
        if (bytes) {
            spans[used].start = start;
            spans[used].end = start + bytes;
            if (lo == NULL || start < lo) lo = start;
            if (hi == NULL || start + bytes > hi) hi = start + bytes;
            used++;
        }
    }
    int apart = disjoint(spans, used);
    PyMem_Free(spans);
    Py_ssize_t low = lo ? (Py_ssize_t)(size_t)lo : -1, high = hi ? (Py_ssize_t)(size_t)hi : -1;
    PyObject *result = Py_BuildValue("(NNnnO)", counts, addrs, low, high, apart ? Py_True : Py_False);
    return result;
fail:
    PyMem_Free(spans);
    Py_XDECREF(counts);
    Py_XDECREF(addrs);
    return PyErr_Occurred() ? NULL : PyErr_NoMemory();
}

static PyObject *bind(PyObject *m, PyObject *args) {
    PyObject *ndarray, *dtypes, *fns[KINDS];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOO:bind", &PyType_Type, &ndarray, &PyDict_Type, &dtypes, &fns[INPUT],
                          &fns[OUTPUT], &fns[INOUT], &fns[PAIR], &fns[OVERLAP], &fns[SPANS]))
        return NULL;
    for (int k = 0; k < KINDS; k++) {
        if (!PyCallable_Check(fns[k])) {
            PyErr_SetString(PyExc_TypeError, "bind: the Python functions must be callable");
            return NULL;
        }
    }
    for (int k = 0; k < KINDS; k++) {
        Py_INCREF(fns[k]);
        Py_XSETREF(S.slow[k], fns[k]);
    }
    Py_INCREF(dtypes);
    Py_XSETREF(S.dtypes, dtypes);
    Py_INCREF(ndarray);
    Py_XSETREF(S.ndarray, (PyTypeObject *)ndarray);
    Py_RETURN_NONE;
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL | METH_KEYWORDS, doc}
static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(ndarray, DTYPES, prepare_input, prepare_output, prepare_inout, prepare_pair, may_overlap, byte_spans)"},
    FAST(prepare_input, "host.prepare_input, with the readiness check in C"),
    FAST(prepare_output, "host.prepare_output, with the readiness check in C"),
    FAST(prepare_inout, "host.prepare_inout, with the readiness check in C"),
    FAST(prepare_pair, "host.prepare_pair, with the readiness check in C"),
    FAST(may_overlap, "host.may_overlap: numpy arrays by the byte ranges they span, in C"),
    FAST(byte_spans, "host.byte_spans of C-contiguous numpy arrays, in C"),
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ready", "The array layer's readiness check in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__ready(void) {
    import_array(); /* numpy's C API: the item size of any dtype (numpy 1.x and 2.x lay it out differently) */
    return PyModule_Create(&module);
}
