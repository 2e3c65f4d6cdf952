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
 * A plain torch CPU tensor (exact torch.Tensor or torch.nn.Parameter, strided, of a
 * dtype mpidist sends, without the negative or conjugate bit) is ready too, once
 * `bind_torch` has been called (host.py does on the first tensor it sees): its
 * numpy view is made here (`tensor_view`), as host.host_view makes it (zero-copy,
 * strides kept, the tensor as the view's base, the storage left resizable), from
 six of torch's attribute reads and method calls instead of Python frames and an
 * __array_interface__ dict. A tensor that is not C-contiguous (staged anyway), and
 * anything a torch call refuses (sparse, nested), goes to the Python function with
 * the arguments unchanged, which gives the same answer or error.
 *
 * may_overlap(a, b) of two numpy arrays compares the byte ranges their elements
 * span (numpy's bounds check, as numpy.may_share_memory); anything else goes to
 * host.may_overlap. byte_spans(arrays) of a list or tuple of C-contiguous exact
 * numpy arrays gives host.byte_spans's answer (sorting the spans to decide whether
 * they are disjoint); anything else goes to host.byte_spans.
 *
 * The rules are host.py's; tests/arrays/test_arrays.py checks that both give the same answers.
 *
 * Only public contracts: numpy arrays through numpy's C API (PyArray_* after import_array), torch
 * tensors through torch's Python-level members. The module keeps process-wide state (what `bind`
 * gave), so it uses single-phase initialization and declares that it needs the GIL on
 * free-threaded Python (3.13+).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NPY_TARGET_VERSION NPY_1_23_API_VERSION /* the oldest numpy mpidist supports (pyproject.toml) */
#include <numpy/arrayobject.h>

enum { INPUT, OUTPUT, INOUT, PAIR, OVERLAP, SPANS, KINDS };

static struct {
    PyObject *dtypes;      /* arrays.dtypes.DTYPES: the supported dtypes (dict keys); NULL before bind */
    PyObject *slow[KINDS]; /* the Python functions */
    PyTypeObject *tensor;  /* torch.Tensor, after bind_torch */
    PyTypeObject *param;   /* torch.nn.Parameter */
    PyObject *torch_dtypes; /* torch dtype -> numpy dtype (host.torch_dtypes) */
    PyObject *torch[7]; /* the descriptors of torch.Tensor's members below (see TORCH_NAMES) */
} S;

/* the members of torch.Tensor read here: attributes (getset descriptors) and methods without arguments,
 * called through their descriptors found once (no attribute lookup per call) */
enum { IS_CPU, DTYPE, SHAPE, IS_CONTIGUOUS, DATA_PTR, IS_NEG, IS_CONJ, TORCH_MEMBERS };
static const char *const TORCH_NAMES[TORCH_MEMBERS] = {"is_cpu", "dtype", "shape", "is_contiguous",
                                                       "data_ptr", "is_neg", "is_conj"};

/* x.<member> or x.<member>() (a new reference, or NULL with an error set) */
static PyObject *member(PyObject *x, int which) {
    PyObject *d = S.torch[which];
    descrgetfunc get = Py_TYPE(d)->tp_descr_get;
    if (which <= SHAPE && get != NULL) return get(d, x, (PyObject *)Py_TYPE(x));
    return PyObject_Vectorcall(d, &x, 1, NULL);
}

/* 1 if `x` goes to MPI as it is; 0 if not (or before bind) */
static int ready(PyObject *x, int writeable) {
    if (S.dtypes == NULL || !PyArray_CheckExact(x)) return 0;
    PyArrayObject *a = (PyArrayObject *)x;
    if (!PyArray_CHKFLAGS(a, NPY_ARRAY_C_CONTIGUOUS | (writeable ? NPY_ARRAY_WRITEABLE : 0))) return 0;
    int known = PyDict_Contains(S.dtypes, (PyObject *)PyArray_DESCR(a));
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

/* 1 if torch's `x.<member>` (or `x.<member>()`) answers exactly `want` (Py_True/Py_False) */
static int answers(PyObject *x, int which, PyObject *want) {
    PyObject *got = member(x, which);
    if (got == NULL) return 0;
    int same = got == want;
    Py_DECREF(got);
    return same;
}

/* the n items of a tuple of ints (torch.Size, or stride()'s tuple) into `out`; 0 on anything else */
static int ints(PyObject *t, npy_intp *out, int n, npy_intp scale) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) return 0;
    for (int i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, i));
        if (v == -1 && PyErr_Occurred()) return 0;
        out[i] = (npy_intp)v * scale;
    }
    return 1;
}

/* A new reference to the numpy view of plain CPU tensor `x`, or NULL (no error set) where the
 * Python path must decide (also every tensor that is not C-contiguous: it is staged anyway).
 * host.host_view's rules: see the comment at the top. */
static PyObject *tensor_view(PyObject *x) {
    PyTypeObject *type = Py_TYPE(x);
    if (S.tensor == NULL || (type != S.tensor && type != S.param)) return NULL;
    PyObject *view = NULL, *dtype = NULL, *shape = NULL, *ptr = NULL;
    if (!answers(x, IS_CPU, Py_True) || !answers(x, IS_NEG, Py_False)) goto done;
    dtype = member(x, DTYPE);
    if (dtype == NULL) goto done;
    PyArray_Descr *descr = (PyArray_Descr *)PyDict_GetItemWithError(S.torch_dtypes, dtype); /* borrowed */
    if (descr == NULL) goto done;
    /* only complex tensors can carry the conjugate bit */
    if (PyDataType_ISCOMPLEX(descr) && !answers(x, IS_CONJ, Py_False)) goto done;
    /* C-contiguous only (the rest is staged by the Python path): no stride() tuple to make and read */
    if (!answers(x, IS_CONTIGUOUS, Py_True)) goto done;
    shape = member(x, SHAPE); /* sparse and nested tensors refuse is_contiguous() or data_ptr() */
    if (shape == NULL || !PyTuple_Check(shape)) goto done;
    int nd = (int)PyTuple_GET_SIZE(shape);
    npy_intp dims[NPY_MAXDIMS], steps[NPY_MAXDIMS];
    if (nd > NPY_MAXDIMS || !ints(shape, dims, nd, 1)) goto done;
    npy_intp step = (npy_intp)PyDataType_ELSIZE(descr);
    for (int i = nd - 1; i >= 0; i--) { /* torch's contiguous strides (a size-1 axis may have any stride) */
        steps[i] = step;
        step *= dims[i] > 1 ? dims[i] : 1;
    }
    ptr = member(x, DATA_PTR);
    if (ptr == NULL) goto done;
    void *data = PyLong_AsVoidPtr(ptr);
    if (data == NULL) goto done; /* an empty tensor (numpy would allocate memory for a NULL address) */
    Py_INCREF(descr); /* NewFromDescr steals it */
    view = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, steps, data, NPY_ARRAY_WRITEABLE, NULL);
    if (view == NULL) goto done;
    Py_INCREF(x);
    if (PyArray_SetBaseObject((PyArrayObject *)view, x) < 0) { /* the view keeps the tensor alive */
        Py_DECREF(x);
        Py_CLEAR(view);
    }
done:
    if (view == NULL) PyErr_Clear();
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(ptr);
    return view;
}

/* `x` itself if ready, else the view of a plain CPU tensor if that is ready (a new reference
 * either way), else NULL with no error set */
static PyObject *ready_or_view(PyObject *x, int writeable) {
    if (ready(x, writeable)) {
        Py_INCREF(x);
        return x;
    }
    PyObject *view = tensor_view(x);
    if (view != NULL && !ready(view, writeable)) Py_CLEAR(view);
    return view;
}

static PyObject *prepare_input(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *a = nargs >= 1 ? ready_or_view(args[0], 0) : NULL;
    return a ? a : slow(INPUT, args, (size_t)nargs, kwnames);
}

/* prepare_output and prepare_inout: (buffer, None) */
static PyObject *writable(int kind, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *a = nargs >= 1 ? ready_or_view(args[0], 1) : NULL;
    if (a == NULL) return slow(kind, args, (size_t)nargs, kwnames);
    PyObject *pair = PyTuple_Pack(2, a, Py_None);
    Py_DECREF(a);
    return pair;
}

static PyObject *prepare_output(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return writable(OUTPUT, args, nargs, kwnames);
}

static PyObject *prepare_inout(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return writable(INOUT, args, nargs, kwnames);
}

static PyObject *prepare_pair(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs < 2) return slow(PAIR, args, (size_t)nargs, kwnames);
    PyObject *out = ready_or_view(args[0], 1);
    PyObject *in = out ? ready_or_view(args[1], 0) : NULL;
    if (in == NULL) {
        Py_XDECREF(out);
        return slow(PAIR, args, (size_t)nargs, kwnames);
    }
    PyObject *triple = PyTuple_Pack(3, out, Py_None, in);
    Py_DECREF(out);
    Py_DECREF(in);
    return triple;
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
        if (!PyArray_CheckExact(items[i]) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)items[i]))
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
    PyObject *dtypes, *fns[KINDS];
    if (!PyArg_ParseTuple(args, "O!OOOOOO:bind", &PyDict_Type, &dtypes, &fns[INPUT],
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
    Py_RETURN_NONE;
}

static PyObject *bind_torch(PyObject *m, PyObject *args) {
    PyObject *tensor, *param, *table;
    if (!PyArg_ParseTuple(args, "O!O!O!:bind_torch", &PyType_Type, &tensor, &PyType_Type, &param, &PyDict_Type,
                          &table))
        return NULL;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(table, &pos, &key, &value)) {
        if (!PyArray_DescrCheck(value)) {
            PyErr_SetString(PyExc_TypeError, "bind_torch: the table's values must be numpy dtypes");
            return NULL;
        }
    }
    PyObject *found[TORCH_MEMBERS];
    int same_in_param = 1;
    for (int i = 0; i < TORCH_MEMBERS; i++) {
        found[i] = PyObject_GetAttrString(tensor, TORCH_NAMES[i]); /* on the class: the descriptor itself */
        PyObject *in_param = found[i] ? PyObject_GetAttrString(param, TORCH_NAMES[i]) : NULL;
        if (in_param == NULL) {
            for (int j = 0; j <= i; j++) Py_XDECREF(found[j]);
            return NULL;
        }
        same_in_param &= in_param == found[i];
        Py_DECREF(in_param);
    }
    for (int i = 0; i < TORCH_MEMBERS; i++) Py_XSETREF(S.torch[i], found[i]);
    if (!same_in_param) param = tensor; /* a torch whose Parameter overrides one of them: plain tensors only */
    Py_INCREF(table);
    Py_XSETREF(S.torch_dtypes, table);
    Py_INCREF(param);
    Py_XSETREF(S.param, (PyTypeObject *)param);
    Py_INCREF(tensor);
    Py_XSETREF(S.tensor, (PyTypeObject *)tensor);
    Py_RETURN_NONE;
}

static PyObject *view_of_tensor(PyObject *m, PyObject *x) {
    PyObject *view = tensor_view(x);
    if (view == NULL) Py_RETURN_NONE;
    return view;
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL | METH_KEYWORDS, doc}
static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(DTYPES, prepare_input, prepare_output, prepare_inout, prepare_pair, may_overlap, byte_spans)"},
    {"bind_torch", bind_torch, METH_VARARGS,
     "bind_torch(torch.Tensor, torch.nn.Parameter, {torch dtype: numpy dtype})"},
    {"tensor_view", view_of_tensor, METH_O, "the numpy view of a plain CPU tensor made here, or None (for tests)"},
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
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    if (m != NULL) PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED); /* free-threaded Python: S assumes the GIL */
#endif
    return m;
}
