/* mpidist.backends._halfops: MPI reductions on float16 and bfloat16 at memory speed.
 *
 * MPICH reduces MPI_FLOAT16_T in a slow software loop, has no bfloat16 type that
 * reduces, and Open MPI has neither. This module creates MPI user-defined,
 * commutative ops that reduce the 2-byte numbers where they are, for
 * backends/halfops.py:
 *
 *   SUM, PROD   each pair is combined in float32 and rounded back to the 2-byte
 *               type to nearest even (float32 holds 2p+2 bits of either type, so
 *               this is the correctly rounded result, as MPICH's float16 and
 *               numpy's and ml_dtypes' per-element arithmetic give); a NaN stays
 *               a NaN (float16: its payload's top bits, numpy's conversion;
 *               bfloat16: 0x7fc0 with the sign, ml_dtypes' conversion);
 *   MIN, MAX    IEEE 754-2019 minimum/maximum, the rule of mpidist's order keys
 *               (reduce_op.to_order_keys): a NaN anywhere gives the default quiet
 *               NaN (0x7e00, 0x7fc0), -0 < +0. The bits are compared as keys, no
 *               conversion at all.
 *
 * and `divide(a, n, bf16)`: AVG's division of a summed array in place, rounded as
 * numpy's float16 division (and ml_dtypes' cast of the float32 quotient) rounds.
 *
 * The loops are plain C over uint16 bits with branch-free conversions, which the
 * compiler vectorizes (-O3 in setup.py; an AVX2 clone where GCC builds x86-64).
 * On x86-64 CPUs with F16C, float16 SUM, PROD and the division convert with the
 * CPU's instructions instead, and with AVX2 bfloat16 SUM and PROD run a hand-vectorized
 * loop (same results; `float16_loops` and `bfloat16_loops` say which).
 *
 * No MPI header is needed: MPI_Op_create is the one mpi4py's extension module is
 * linked with (dlsym, as backends/_direct.c finds its functions), and the op
 * handle it writes is an int (MPICH ABI) or a pointer (Open MPI), as the caller
 * says. The datatype argument of the user functions is never read. The ops are
 * created once per process and never freed: MPI_Finalize releases them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* -- conversions (branch-free, so that loops over them vectorize) ------------------------------------ */
static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* a if cond else b, as bit masks: no branch for the compiler to keep (it would not if-convert the float ops) */
static inline uint32_t pick(int cond, uint32_t a, uint32_t b) {
    uint32_t m = 0u - (uint32_t)(cond != 0);
    return (a & m) | (b & ~m);
}

/* float16 bits -> float (exact) */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t normal = (em << 13) + (112u << 23);                /* rebias the exponent (15 -> 127) */
    uint32_t special = (em << 13) | 0x7f800000u;                 /* inf, NaN (payload kept) */
    uint32_t tiny = bits_of(float_of(0x3f000000u | em) - 0.5f); /* subnormal, zero: em * 2^-24 */
    uint32_t r = pick(em >= 0x7c00u, special, pick(em < 0x0400u, tiny, normal));
    return float_of(sign | r);
}

/* float -> float16 bits, rounded to nearest even; overflow gives inf; a NaN stays a quiet NaN */
static inline uint16_t f2h(float f) {
    uint32_t u = bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    /* normal: rebias and round on the 13 dropped bits (a carry into the exponent is right, up to inf) */
    uint32_t normal = (a - (112u << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5f makes the FPU round at 2^-24, float16's smallest step */
    uint32_t tiny = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
    uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x03ffu)) : 0x7c00u;
    uint32_t r = pick(a >= 0x47800000u, special, pick(a < 0x38800000u, tiny, normal));
    return (uint16_t)(sign | r);
}

/* bfloat16 bits -> float (exact) */
static inline float b2f(uint16_t b) { return float_of((uint32_t)b << 16); }

/* float -> bfloat16 bits, rounded to nearest even; a NaN becomes 0x7fc0 with its sign (as ml_dtypes) */
static inline uint16_t f2b(float f) {
    uint32_t u = bits_of(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* the order key of a 2-byte float: two's-complement order is the numbers' order, -0 < +0 */
static inline int16_t key(uint16_t x) {
    int16_t s = (int16_t)x;
    return (int16_t)(s ^ ((s >> 15) & 0x7fff));
}

/* -- the user functions: inout[i] = in[i] op inout[i] ------------------------------------------------
 * SUM and PROD order the operands by their bits first: the numbers' result is the same either way, and
 * where both are NaN the CPU returns one operand's payload (the compiler fixes which), so every rank gets
 * the same NaN whichever side of the op MPI's algorithm hands it (with MPICH's own float16 sum, ranks got
 * different NaNs). */
#define ARITH(name, from, to, expr)                                                        \
    CLONES static void name(void *in, void *inout, int *len, void *datatype) {             \
        const uint16_t *restrict a = (const uint16_t *)in;                                 \
        uint16_t *restrict b = (uint16_t *)inout;                                          \
        int n = *len;                                                                      \
        (void)datatype;                                                                    \
        for (int i = 0; i < n; i++) {                                                      \
            uint16_t p = a[i], q = b[i];                                                   \
            float x = from(p < q ? p : q), y = from(p < q ? q : p);                        \
            b[i] = to(expr);                                                               \
        }                                                                                  \
    }

/* MAX: the larger key; MIN: the smaller; a NaN on either side: the default quiet NaN */
#define ORDER(name, cmp, inf, qnan)                                                          \
    CLONES static void name(void *in, void *inout, int *len, void *datatype) {               \
        const uint16_t *restrict a = (const uint16_t *)in;                                   \
        uint16_t *restrict b = (uint16_t *)inout;                                            \
        int n = *len;                                                                        \
        (void)datatype;                                                                      \
        for (int i = 0; i < n; i++) {                                                        \
            uint16_t x = a[i], y = b[i];                                                     \
            uint16_t r = key(x) cmp key(y) ? x : y;                                          \
            int nan = ((x & 0x7fffu) > (inf)) | ((y & 0x7fffu) > (inf));                     \
            b[i] = nan ? (uint16_t)(qnan) : r;                                               \
        }                                                                                    \
    }

ARITH(f16_sum, h2f, f2h, x + y)
ARITH(f16_prod, h2f, f2h, x * y)
ORDER(f16_min, <, 0x7c00u, 0x7e00u)
ORDER(f16_max, >, 0x7c00u, 0x7e00u)
ARITH(bf16_sum, b2f, f2b, x + y)
ARITH(bf16_prod, b2f, f2b, x * y)
ORDER(bf16_min, <, 0x7f80u, 0x7fc0u)
ORDER(bf16_max, >, 0x7f80u, 0x7fc0u)

typedef void user_fn(void *, void *, int *, void *);

CLONES static void f16_divide(uint16_t *restrict a, Py_ssize_t n, float d) {
    for (Py_ssize_t i = 0; i < n; i++) a[i] = f2h(h2f(a[i]) / d);
}

CLONES static void bf16_divide(uint16_t *restrict a, Py_ssize_t n, float d) {
    for (Py_ssize_t i = 0; i < n; i++) a[i] = f2b(b2f(a[i]) / d);
}

/* -- x86-64: float16 with the CPU's conversion instructions (F16C: 8 numbers per instruction), bfloat16 with AVX2
 * The same results as the loops above (round to nearest even; a quiet NaN keeps its payload's top bits),
 * about 4x faster: the bit-level float16 conversions cost more than the memory traffic. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_F16C 1
#define F16C_TARGET __attribute__((target("avx,f16c")))
#define ROUND_EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#define F16C_ARITH(name, vop, expr)                                                                      \
    F16C_TARGET static void name(void *in, void *inout, int *len, void *datatype) {                      \
        const uint16_t *a = (const uint16_t *)in;                                                        \
        uint16_t *b = (uint16_t *)inout;                                                                 \
        int n = *len, i = 0;                                                                             \
        (void)datatype;                                                                                  \
        for (; i + 8 <= n; i += 8) {                                                                     \
            __m128i p = _mm_loadu_si128((const __m128i *)(a + i));                                       \
            __m128i q = _mm_loadu_si128((const __m128i *)(b + i));                                       \
            __m256 x = _mm256_cvtph_ps(_mm_min_epu16(p, q)), y = _mm256_cvtph_ps(_mm_max_epu16(p, q));   \
            _mm_storeu_si128((__m128i *)(b + i), _mm256_cvtps_ph(vop(x, y), ROUND_EVEN));                \
        }                                                                                                \
        for (; i < n; i++) {                                                                             \
            uint16_t p = a[i], q = b[i];                                                                 \
            float x = h2f(p < q ? p : q), y = h2f(p < q ? q : p);                                        \
            b[i] = f2h(expr);                                                                            \
        }                                                                                                \
    }

F16C_ARITH(f16_sum_f16c, _mm256_add_ps, x + y)
F16C_ARITH(f16_prod_f16c, _mm256_mul_ps, x * y)

F16C_TARGET static void f16_divide_f16c(uint16_t *a, Py_ssize_t n, float d) {
    __m256 dv = _mm256_set1_ps(d);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        _mm_storeu_si128((__m128i *)(a + i), _mm256_cvtps_ph(_mm256_div_ps(x, dv), ROUND_EVEN));
    }
    for (; i < n; i++) a[i] = f2h(h2f(a[i]) / d);
}

static int has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}

/* bfloat16 with AVX2: 16 numbers per step, widened by interleaving with zero halves, rounded as f2b and packed
 * back (the 128-bit lanes' order is undone by the pack); about 3x the compiled loop */
#define AVX2_TARGET __attribute__((target("avx2")))

AVX2_TARGET static inline __m256i bf16_round(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                   _mm256_set1_epi32(0x7fc0));
    return _mm256_blendv_epi8(r, qnan, nan);
}

#define AVX2_BF16(name, vop, expr)                                                                       \
    AVX2_TARGET static void name(void *in, void *inout, int *len, void *datatype) {                      \
        const uint16_t *a = (const uint16_t *)in;                                                        \
        uint16_t *b = (uint16_t *)inout;                                                                 \
        int n = *len, i = 0;                                                                             \
        const __m256i zero = _mm256_setzero_si256();                                                     \
        (void)datatype;                                                                                  \
        for (; i + 16 <= n; i += 16) {                                                                   \
            __m256i p = _mm256_loadu_si256((const __m256i *)(a + i));                                    \
            __m256i q = _mm256_loadu_si256((const __m256i *)(b + i));                                    \
            __m256i lo = _mm256_min_epu16(p, q), hi = _mm256_max_epu16(p, q);                            \
            __m256 x0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, lo));                            \
            __m256 y0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, hi));                            \
            __m256 x1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, lo));                            \
            __m256 y1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, hi));                            \
            __m256i r = _mm256_packus_epi32(bf16_round(vop(x0, y0)), bf16_round(vop(x1, y1)));           \
            _mm256_storeu_si256((__m256i *)(b + i), r);                                                  \
        }                                                                                                \
        for (; i < n; i++) {                                                                             \
            uint16_t p = a[i], q = b[i];                                                                 \
            float x = b2f(p < q ? p : q), y = b2f(p < q ? q : p);                                        \
            b[i] = f2b(expr);                                                                            \
        }                                                                                                \
    }

AVX2_BF16(bf16_sum_avx2, _mm256_add_ps, x + y)
AVX2_BF16(bf16_prod_avx2, _mm256_mul_ps, x * y)

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#else
#define HAVE_F16C 0
#endif

/* in the order create() returns the handles; the float16 SUM and PROD (and divide) may be replaced by the
 * F16C loops once (choose()) */
static user_fn *FUNCTIONS[] = {f16_sum, f16_prod, f16_min, f16_max, bf16_sum, bf16_prod, bf16_min, bf16_max};
#define N_OPS (sizeof FUNCTIONS / sizeof FUNCTIONS[0])
static void (*F16_DIVIDE)(uint16_t *, Py_ssize_t, float) = f16_divide;
static const char *F16_LOOPS = "portable loops";
static const char *BF16_LOOPS = "portable loops";

static void choose(void) {
#if HAVE_F16C
    if (has_f16c()) {
        FUNCTIONS[0] = f16_sum_f16c;
        FUNCTIONS[1] = f16_prod_f16c;
        F16_DIVIDE = f16_divide_f16c;
        F16_LOOPS = "F16C";
    }
    if (has_avx2()) {
        FUNCTIONS[4] = bf16_sum_avx2;
        FUNCTIONS[5] = bf16_prod_avx2;
        BF16_LOOPS = "AVX2";
    }
#endif
}

/* -- the module ------------------------------------------------------------------------------------- */
static struct {
    int created;
    size_t handles[N_OPS]; /* as mpi4py shows handles: the unsigned pointer-width value */
} S;

static PyObject *handles_tuple(void) {
    PyObject *t = PyTuple_New(N_OPS);
    if (t == NULL) return NULL;
    for (size_t k = 0; k < N_OPS; k++) {
        PyObject *h = PyLong_FromSize_t(S.handles[k]);
        if (h == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, h);
    }
    return t;
}

/* create(library, int_handles): make the ops with MPI_Op_create from `library` (mpi4py's MPI extension
 * module, loaded already); return their handles (f16 sum, prod, min, max, then bf16's). MPI must be
 * initialized. The same handles on every later call. OSError if MPI_Op_create cannot be found, RuntimeError
 * with MPI's error code if it fails. */
static PyObject *create(PyObject *mod, PyObject *args) {
    const char *library;
    int int_handles;
    if (!PyArg_ParseTuple(args, "sp:create", &library, &int_handles)) return NULL;
    if (S.created) return handles_tuple();
    void *lib = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "create: %s is not loaded", library);
    void *fn = dlsym(lib, "MPI_Op_create");
    if (fn == NULL) return PyErr_Format(PyExc_OSError, "create: MPI_Op_create not found from %s", library);
    for (size_t k = 0; k < N_OPS; k++) {
        int rc;
        if (int_handles) {
            int op = 0;
            rc = ((int (*)(user_fn *, int, int *))fn)(FUNCTIONS[k], 1, &op);
            S.handles[k] = (size_t)(Py_intptr_t)op; /* sign-extended, as mpi4py shows MPICH's handles */
        } else {
            void *op = NULL;
            rc = ((int (*)(user_fn *, int, void **))fn)(FUNCTIONS[k], 1, &op);
            S.handles[k] = (size_t)op;
        }
        if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "create: MPI_Op_create failed with error %d", rc);
    }
    S.created = 1;
    return handles_tuple();
}

/* divide(a, n, bf16): a's float16 (bf16 false) or bfloat16 numbers /= n in place; `a` is a writable,
 * C-contiguous buffer of 2-byte elements (a uint16 view) */
static PyObject *divide(PyObject *mod, PyObject *args) {
    PyObject *obj;
    int n, bf16;
    if (!PyArg_ParseTuple(args, "Oip:divide", &obj, &n, &bf16)) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "divide: n must be positive, got %d", n);
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (view.itemsize != 2 || view.len % 2 != 0) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_TypeError, "divide: a must hold 2-byte elements, got %zd-byte ones", view.itemsize);
    }
    Py_ssize_t count = view.len / 2;
    Py_BEGIN_ALLOW_THREADS
    if (bf16)
        bf16_divide((uint16_t *)view.buf, count, (float)n);
    else
        F16_DIVIDE((uint16_t *)view.buf, count, (float)n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"create", create, METH_VARARGS, "create(library, int_handles): the ops' MPI handles (made once)"},
    {"divide", divide, METH_VARARGS, "divide(a, n, bf16): a /= n in place (a: uint16 view of float16/bfloat16)"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_halfops",
                                    "MPI reductions on float16 and bfloat16 (user-defined ops).", -1, module_methods};

PyMODINIT_FUNC PyInit__halfops(void) {
    choose();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddStringConstant(m, "float16_loops", F16_LOOPS) < 0 ||
                      PyModule_AddStringConstant(m, "bfloat16_loops", BF16_LOOPS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    if (m != NULL) PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED); /* free-threaded Python: S assumes the GIL */
#endif
    return m;
}
