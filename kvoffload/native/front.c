/* kvoffload's call front: the calls into the native library that every job of a native issuer
 * makes on the engine's thread (the admission check of its block ids, the early wake of an idle
 * issuer thread and the hand-off to the issuer thread at submit; the job's wait, its result taken
 * with its reference released in the same call, and the uncount of its blocks), as a CPython
 * extension module (docs/design.md §16).
 *
 * Through ctypes, each call converts its arguments one by one and each id array's address is read
 * through a ctypes object: about 1.4 us for the admission and 2 us around the hand-off on a 2-core
 * host, more than the C they call (and the result's out-arrays are ctypes objects built per call). Here a call takes its arguments as a vector (METH_FASTCALL),
 * reads the id arrays through the buffer protocol, and finds the library's functions and the
 * per-direction constants in a struct Python filled once (struct kvo_front_spec). The library
 * itself (issuer.c) is unchanged and still loaded through ctypes: this module only calls it. Every
 * call that takes the issuer's lock or may wait releases the GIL, as ctypes does: the thread holding
 * that lock may need the GIL (a driver of Python callbacks, as the CPU tests' fake driver).
 *
 * Built by kvoffload.native with Python's headers where they are installed; without them the
 * ctypes calls are used, with the same results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { JOB_DONE = 2 }; /* kvo_job_take's state of a done job */

typedef int64_t (*fn_admit)(const int64_t *, const int64_t *, int64_t, int64_t, int64_t,
                            const int32_t *, int32_t *, const int32_t *, int32_t *, int32_t *,
                            int64_t *);
typedef void *(*fn_hand_off)(void *, void *, void *, int64_t, int64_t, const int64_t *,
                             const int64_t *, int64_t, void *const *, int64_t, int64_t, int64_t *);
typedef void (*fn_unadmit)(const int64_t *, const int64_t *, int64_t, int32_t *, int32_t *);
typedef int64_t (*fn_job_take)(void *, int64_t, int64_t *, double *, const char **);
typedef int64_t (*fn_job_wait)(void *, int64_t);
typedef void (*fn_job_release)(void *);
typedef int64_t (*fn_expect)(void *);
typedef int64_t (*fn_hand_off_booked)(void *, int64_t, int64_t, void *, void *, int64_t, int64_t,
                                      const int64_t *, const int64_t *, int64_t, void *const *,
                                      int64_t, int64_t, void **);
typedef int64_t (*fn_book_take)(void *, int64_t, int64_t *, double *, const char **);
typedef int64_t (*fn_book_wait)(void *, int64_t, int64_t, int64_t);
enum { BOOK_FIELDS = 9, TAKE_MAX = 64 }; /* kvo_book_take's fields of a result; results a call takes */

/* Filled by Python (kvoffload.native.FrontSpec, 8-byte fields): one per admission direction and
 * one per issuer. */
struct kvo_front_spec {
    void *admit, *hand_off;          /* the library's kvo_admit and kvo_hand_off */
    int64_t src_limit, dst_limit;    /* kvo_admit's constants of one direction */
    int32_t *src_writes, *src_reads, *dst_reads, *dst_writes, *stamp;
    int64_t *token;
    void *issuer;                    /* kvo_hand_off's issuer */
    int64_t error;                   /* the last failed hand-off's code */
    void *unadmit, *job_take, *job_wait, *job_release; /* the library's kvo_* */
    void *expect;                    /* the library's kvo_issuer_expect */
    void *hand_off_booked, *book_take, *book_wait; /* the library's kvo_* */
    void *marks_job;                 /* the last booked hand-off's layered job (its marks') */
};

/* A one-dimensional, C-contiguous int64 buffer of `obj`, or 0 (no exception set) for anything else. */
static int id_buffer(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (f && (*f == '<' || *f == '=' || *f == '@')) f++; /* native order: little-endian hosts */
    if (view->ndim == 1 && view->itemsize == 8 && f && (f[0] == 'l' || f[0] == 'q') && f[1] == 0)
        return 1;
    PyBuffer_Release(view);
    return 0;
}

/* The spec, the first of a call's `nargs` arguments, or 0 with an exception set: a count other
 * than `want` (`usage` names the call) or a null spec. */
static struct kvo_front_spec *spec_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                                       const char *usage) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", usage, want);
        return 0;
    }
    void *p = PyLong_AsVoidPtr(args[0]);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null spec");
    return p;
}

/* The job, the second argument of a call checked as spec_arg checks it (*spec set), or 0 with an
 * exception set (also for a null job). */
static void *job_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage,
                     struct kvo_front_spec **spec) {
    *spec = spec_arg(args, nargs, want, usage);
    if (!*spec) return 0;
    void *p = PyLong_AsVoidPtr(args[1]);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null job");
    return p;
}

/* Two id buffers of one length (1 with both views held), or 0 with a TypeError naming the array
 * that is not a 1-D contiguous int64 array or a ValueError for two lengths, and no view held. */
static int id_pair(PyObject *a, PyObject *b, Py_buffer *x, Py_buffer *y, const char *a_name,
                   const char *b_name) {
    if (!id_buffer(a, x)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous int64 array", a_name);
        return 0;
    }
    if (!id_buffer(b, y)) {
        PyBuffer_Release(x);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous int64 array", b_name);
        return 0;
    }
    if (x->len != y->len) {
        PyBuffer_Release(y);
        PyBuffer_Release(x);
        PyErr_Format(PyExc_ValueError, "%s and %s differ in length", a_name, b_name);
        return 0;
    }
    return 1;
}

/* admit(spec, reads, writes) -> bool: True when the job was admitted and counted; False (nothing
 * counted) when the arrays are not 1-D contiguous int64 of one non-zero length or a check failed. */
static PyObject *front_admit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 3, "admit(spec, reads, writes)");
    if (!s) return 0;
    Py_buffer r, w;
    if (!id_buffer(args[1], &r)) Py_RETURN_FALSE;
    if (!id_buffer(args[2], &w)) {
        PyBuffer_Release(&r);
        Py_RETURN_FALSE;
    }
    int64_t n = (int64_t)(r.len / 8);
    int64_t failed = 0;
    if (n != (int64_t)(w.len / 8) || n == 0) failed = 1;
    else failed = ((fn_admit)s->admit)(r.buf, w.buf, n, s->src_limit, s->dst_limit, s->src_writes,
                                       s->src_reads, s->dst_reads, s->dst_writes, s->stamp,
                                       s->token) >= 0;
    PyBuffer_Release(&w);
    PyBuffer_Release(&r);
    if (failed) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* hand_off(spec, stream, fence, path, device_ids, host_ids, nplans, plans, first, layered) -> int:
 * the job's address, or 0 with the code in spec->error. The GIL is released for the call (it may
 * wait behind the driver). */
static PyObject *front_hand_off(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 10, "hand_off");
    if (!s) return 0;
    void *stream = PyLong_AsVoidPtr(args[1]);
    void *fence = PyLong_AsVoidPtr(args[2]);
    int64_t path = PyLong_AsLongLong(args[3]);
    int64_t nplans = PyLong_AsLongLong(args[6]);
    void *plans = PyLong_AsVoidPtr(args[7]);
    int64_t first = PyLong_AsLongLong(args[8]);
    int64_t layered = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return 0;
    Py_buffer d, h;
    if (!id_pair(args[4], args[5], &d, &h, "device ids", "host ids")) return 0;
    int64_t error = 0;
    void *job;
    Py_BEGIN_ALLOW_THREADS
    job = ((fn_hand_off)s->hand_off)(s->issuer, stream, fence, path, (int64_t)(d.len / 8), d.buf,
                                     h.buf, nplans, plans, first, layered, &error);
    Py_END_ALLOW_THREADS
    s->error = error;
    PyBuffer_Release(&h);
    PyBuffer_Release(&d);
    return PyLong_FromVoidPtr(job);
}

/* unadmit(spec, reads, writes) -> None: kvo_unadmit of a job admit() admitted, with the spec's
 * source read counts and destination write counts. */
static PyObject *front_unadmit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 3, "unadmit(spec, reads, writes)");
    if (!s) return 0;
    Py_buffer r, w;
    if (!id_pair(args[1], args[2], &r, &w, "reads", "writes")) return 0;
    ((fn_unadmit)s->unadmit)(r.buf, w.buf, (int64_t)(r.len / 8), s->src_reads, s->dst_writes);
    PyBuffer_Release(&w);
    PyBuffer_Release(&r);
    Py_RETURN_NONE;
}

/* job_wait(spec, job, timeout_ns) -> bool: kvo_job_wait, with the GIL released. */
static PyObject *front_job_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s;
    void *job = job_arg(args, nargs, 3, "job_wait(spec, job, timeout_ns)", &s);
    if (!job) return 0;
    int64_t timeout_ns = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return 0;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = ((fn_job_wait)s->job_wait)(job, timeout_ns);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done != 0);
}

/* job_take(spec, job, release) -> None while the job is not done, else (code, fail, handed, began,
 * issued, found, seconds, call): kvo_job_take, its times in CLOCK_MONOTONIC ns and the failed call's
 * name ("" for none); with `release` true, the caller's reference to the done job goes. */
static PyObject *front_job_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s;
    void *job = job_arg(args, nargs, 3, "job_take(spec, job, release)", &s);
    if (!job) return 0;
    int release = PyObject_IsTrue(args[2]);
    if (release < 0) return 0;
    int64_t out[6] = {0};
    double seconds = 0.0;
    const char *call = "";
    int64_t state;
    Py_BEGIN_ALLOW_THREADS
    state = ((fn_job_take)s->job_take)(job, release, out, &seconds, &call);
    Py_END_ALLOW_THREADS
    if (state != JOB_DONE) Py_RETURN_NONE;
    return Py_BuildValue("(LLLLLLds)", (long long)out[0], (long long)out[1], (long long)out[2],
                         (long long)out[3], (long long)out[4], (long long)out[5], seconds,
                         call ? call : "");
}

/* job_release(spec, job) -> None: kvo_job_release (the caller's reference to the job goes). */
static PyObject *front_job_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s;
    void *job = job_arg(args, nargs, 2, "job_release(spec, job)", &s);
    if (!job) return 0;
    Py_BEGIN_ALLOW_THREADS
    ((fn_job_release)s->job_release)(job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* expect(spec) -> bool: kvo_issuer_expect of the spec's issuer (True when it woke the thread or
 * told it that a caller is coming), with the GIL released (it takes the issuer's lock). */
static PyObject *front_expect(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 1, "expect(spec)");
    if (!s) return 0;
    int64_t woke;
    Py_BEGIN_ALLOW_THREADS
    woke = ((fn_expect)s->expect)(s->issuer);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(woke != 0);
}

/* hand_off_booked(spec, id, tag, stream, path, device_ids, host_ids, nplans, plans, first, layered)
 * -> int: kvo_hand_off_booked (0: booked; else the code of a job not booked), the layered job for
 * its marks in spec->marks_job. The GIL is released for the call (it may wait behind the driver). */
static PyObject *front_hand_off_booked(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 11, "hand_off_booked");
    if (!s) return 0;
    int64_t id = PyLong_AsLongLong(args[1]);
    int64_t tag = PyLong_AsLongLong(args[2]);
    void *stream = PyLong_AsVoidPtr(args[3]);
    int64_t path = PyLong_AsLongLong(args[4]);
    int64_t nplans = PyLong_AsLongLong(args[7]);
    void *plans = PyLong_AsVoidPtr(args[8]);
    int64_t first = PyLong_AsLongLong(args[9]);
    int64_t layered = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return 0;
    Py_buffer d, h;
    if (!id_pair(args[5], args[6], &d, &h, "device ids", "host ids")) return 0;
    int64_t code;
    void *job = 0;
    Py_BEGIN_ALLOW_THREADS
    code = ((fn_hand_off_booked)s->hand_off_booked)(s->issuer, id, tag, stream, 0, path,
                                                    (int64_t)(d.len / 8), d.buf, h.buf, nplans,
                                                    plans, first, layered, &job);
    Py_END_ALLOW_THREADS
    s->marks_job = job;
    PyBuffer_Release(&h);
    PyBuffer_Release(&d);
    return PyLong_FromLongLong(code);
}

/* book_take(spec) -> list of (id, code, fail, pairs, tag, seconds, call, handed, began, issued,
 * found), one per finished job
 * at the head of the book, in hand-off order (kvo_book_take until it takes fewer than it may). */
static PyObject *front_book_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 1, "book_take(spec)");
    if (!s) return 0;
    PyObject *taken = PyList_New(0);
    if (!taken) return 0;
    int64_t out[BOOK_FIELDS * TAKE_MAX];
    double seconds[TAKE_MAX];
    const char *calls[TAKE_MAX];
    int64_t count;
    do {
        Py_BEGIN_ALLOW_THREADS
        count = ((fn_book_take)s->book_take)(s->issuer, TAKE_MAX, out, seconds, calls);
        Py_END_ALLOW_THREADS
        for (int64_t k = 0; k < count; k++) {
            const int64_t *o = out + k * BOOK_FIELDS;
            PyObject *one = Py_BuildValue("(LLLLLdsLLLL)", (long long)o[0], (long long)o[1],
                                          (long long)o[2], (long long)o[3], (long long)o[4],
                                          seconds[k], calls[k] ? calls[k] : "", (long long)o[5],
                                          (long long)o[6], (long long)o[7], (long long)o[8]);
            if (!one || PyList_Append(taken, one) < 0) { /* the results taken stay unpublished */
                Py_XDECREF(one);
                Py_DECREF(taken);
                return 0;
            }
            Py_DECREF(one);
        }
    } while (count == TAKE_MAX);
    return taken;
}

/* book_wait(spec, id, last, timeout_ns) -> int: kvo_book_wait, with the GIL released. */
static PyObject *front_book_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct kvo_front_spec *s = spec_arg(args, nargs, 4, "book_wait(spec, id, last, timeout_ns)");
    if (!s) return 0;
    int64_t id = PyLong_AsLongLong(args[1]);
    int64_t last = PyLong_AsLongLong(args[2]);
    int64_t timeout_ns = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return 0;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = ((fn_book_wait)s->book_wait)(s->issuer, id, last, timeout_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(done);
}

static PyMethodDef methods[] = {
    {"admit", (PyCFunction)(void (*)(void))front_admit, METH_FASTCALL,
     "admit(spec, reads, writes) -> bool: kvo_admit over the arrays' buffers."},
    {"hand_off", (PyCFunction)(void (*)(void))front_hand_off, METH_FASTCALL,
     "hand_off(spec, stream, fence, path, device_ids, host_ids, nplans, plans, first, layered)"
     " -> int: kvo_hand_off over the arrays' buffers."},
    {"unadmit", (PyCFunction)(void (*)(void))front_unadmit, METH_FASTCALL,
     "unadmit(spec, reads, writes) -> None: kvo_unadmit over the arrays' buffers."},
    {"job_wait", (PyCFunction)(void (*)(void))front_job_wait, METH_FASTCALL,
     "job_wait(spec, job, timeout_ns) -> bool: kvo_job_wait without the GIL."},
    {"job_take", (PyCFunction)(void (*)(void))front_job_take, METH_FASTCALL,
     "job_take(spec, job, release) -> None, or (code, fail, handed, began, issued, found, seconds,"
     " call) once the job is done: kvo_job_take."},
    {"job_release", (PyCFunction)(void (*)(void))front_job_release, METH_FASTCALL,
     "job_release(spec, job) -> None: kvo_job_release."},
    {"expect", (PyCFunction)(void (*)(void))front_expect, METH_FASTCALL,
     "expect(spec) -> bool: kvo_issuer_expect of the spec's issuer, without the GIL."},
    {"hand_off_booked", (PyCFunction)(void (*)(void))front_hand_off_booked, METH_FASTCALL,
     "hand_off_booked(spec, id, tag, stream, path, device_ids, host_ids, nplans, plans, first,"
     " layered) -> int: kvo_hand_off_booked over the arrays' buffers."},
    {"book_take", (PyCFunction)(void (*)(void))front_book_take, METH_FASTCALL,
     "book_take(spec) -> list of (id, code, fail, pairs, tag, seconds, call, handed, began, issued,"
     " found): kvo_book_take."},
    {"book_wait", (PyCFunction)(void (*)(void))front_book_wait, METH_FASTCALL,
     "book_wait(spec, id, last, timeout_ns) -> int: kvo_book_wait without the GIL."},
    {0, 0, 0, 0},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvoffload_front",
    "kvoffload's call front: the native library's per-job calls without ctypes.", -1, methods,
    0, 0, 0, 0,
};

PyMODINIT_FUNC PyInit_kvoffload_front(void) { return PyModule_Create(&module); }
