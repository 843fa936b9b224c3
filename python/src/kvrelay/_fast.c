/* kvrelay._fast: the two per-request calls (an admission, a fetch submission) made from C, for
 * the microsecond a ctypes call costs. Optional: `pip install ./python` builds it where a C
 * compiler is present; without it the package makes the same calls through ctypes.
 *
 * It takes only what it can take as is (exact bytes, exact ints, lists or tuples of exact ints,
 * every value in range, every precondition of the call met) and answers NotImplemented for
 * anything else: the Python wrapper then takes its checking path, whose errors name the
 * argument. It calls the library the package loaded (the functions' addresses come through
 * `bind`, from ctypes), so there is one libkvrelay in the process whatever KVRELAY_LIBRARY says.
 * Neither call blocks: the GIL is held throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvrelay.h"

/* The types of the functions called through the addresses `bind` receives, taken from their
 * declarations in kvrelay.h (never written out here): a change of one in the header is a
 * compile error below, not a call with the old parameters. */
typedef __typeof__(kvrelay_admit) *admit_fn;
typedef __typeof__(kvrelay_agent_submit) *submit_fn;
typedef __typeof__(kvrelay_snapshot_release) *release_fn;

static admit_fn admit_p = NULL;
static submit_fn submit_p = NULL;
static release_fn release_p = NULL;

/* SnapshotRef: one reference to a C snapshot, released when the object dies (the package's
 * `_SnapshotRef` in C: no Python finalizer and no ctypes call per admitted hint). Only `admit`
 * makes one: the type cannot be instantiated from Python (an object made from an address would
 * release a reference nobody gave it). */
typedef struct {
  PyObject_HEAD void *ptr;
  PyObject *weakrefs;
} SnapRef;

static void snapref_dealloc(PyObject *o) {
  SnapRef *s = (SnapRef *)o;
  if (s->weakrefs != NULL) PyObject_ClearWeakRefs(o);
  void *p = s->ptr;
  s->ptr = NULL;
  if (p != NULL && release_p != NULL) release_p((struct kvrelay_snapshot *)p);
  Py_TYPE(o)->tp_free(o);
}

static PyObject *snapref_ptr(PyObject *o, void *closure) {
  (void)closure;
  SnapRef *s = (SnapRef *)o;
  if (s->ptr == NULL) Py_RETURN_NONE;
  return PyLong_FromVoidPtr(s->ptr);
}

static PyGetSetDef snapref_getset[] = {
    {"ptr", snapref_ptr, NULL, "the snapshot's address", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Not instantiable from Python: no tp_new (a static type whose base is object does not inherit
 * one), and the flag that says so where the Python version has it (3.10+). */
#ifdef Py_TPFLAGS_DISALLOW_INSTANTIATION
#define SNAPREF_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION)
#else
#define SNAPREF_FLAGS Py_TPFLAGS_DEFAULT
#endif

static PyTypeObject SnapRefType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvrelay._fast.SnapshotRef",
    .tp_basicsize = sizeof(SnapRef),
    .tp_dealloc = snapref_dealloc,
    .tp_flags = SNAPREF_FLAGS,
    .tp_doc = "One reference to a C snapshot, released when this object dies (made by admit only).",
    .tp_weaklistoffset = offsetof(SnapRef, weakrefs),
    .tp_getset = snapref_getset,
    .tp_new = NULL,
};

/* Ids converted on the stack up to this many; a larger request allocates. */
#define STACK_IDS 512

static PyObject *not_implemented(void) {
  PyErr_Clear();
  Py_INCREF(Py_NotImplemented);
  return Py_NotImplemented;
}

/* An address from a Python int: NULL (no error set) when it is not one or is 0. */
static void *address(PyObject *o) {
  if (!PyLong_CheckExact(o)) return NULL;
  void *p = PyLong_AsVoidPtr(o);
  if (p == NULL) PyErr_Clear();
  return p;
}

/* bind(admit, submit, release): the addresses of kvrelay_admit, kvrelay_agent_submit and
 * kvrelay_snapshot_release. */
static PyObject *fast_bind(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  (void)self;
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "bind(admit, submit, release) takes three addresses");
    return NULL;
  }
  void *a = address(args[0]), *s = address(args[1]), *r = address(args[2]);
  if (a == NULL || s == NULL || r == NULL) {
    PyErr_SetString(PyExc_ValueError, "bind: an address is not a non-zero int");
    return NULL;
  }
  /* POSIX: a function's address travels as a data pointer (dlsym does the same) */
  memcpy(&admit_p, &a, sizeof a);
  memcpy(&submit_p, &s, sizeof s);
  memcpy(&release_p, &r, sizeof r);
  Py_RETURN_NONE;
}

/* admit(admission, raw) -> (kind, reason, detail, SnapshotRef | None) | status | NotImplemented.
 * `raw` exact bytes or None; `detail` the malformed reason's text, else "". */
static PyObject *fast_admit(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  (void)self;
  if (n != 2 || admit_p == NULL || release_p == NULL) return not_implemented();
  void *p = address(args[0]);
  if (p == NULL) return not_implemented();
  const uint8_t *buf = NULL;
  size_t len = 0;
  if (PyBytes_CheckExact(args[1])) {
    buf = (const uint8_t *)PyBytes_AS_STRING(args[1]);
    len = (size_t)PyBytes_GET_SIZE(args[1]);
  } else if (args[1] != Py_None) {
    return not_implemented();
  }
  struct kvrelay_outcome o;
  o.size = sizeof o;
  struct kvrelay_snapshot *snap = NULL;
  kvrelay_status st = admit_p((const struct kvrelay_admission *)p, buf, len, &o, &snap);
  if (st != KVRELAY_OK) return PyLong_FromLong((long)st);
  PyObject *detail;
  if (o.reason == KVRELAY_REASON_MALFORMED) {
    size_t k = 0;
    while (k < sizeof o.detail && o.detail[k] != '\0') k++;
    detail = PyUnicode_DecodeUTF8(o.detail, (Py_ssize_t)k, "replace");
  } else {
    detail = PyUnicode_FromStringAndSize("", 0);
  }
  PyObject *kind = PyLong_FromLong((long)o.kind), *reason = PyLong_FromLong((long)o.reason);
  PyObject *handle;
  if (snap == NULL) {
    Py_INCREF(Py_None);
    handle = Py_None;
  } else {
    SnapRef *r = (SnapRef *)SnapRefType.tp_alloc(&SnapRefType, 0);
    if (r != NULL) {
      r->ptr = snap;
      snap = NULL; /* the SnapshotRef owns it now */
    }
    handle = (PyObject *)r;
  }
  PyObject *t = PyTuple_New(4);
  if (detail == NULL || kind == NULL || reason == NULL || handle == NULL || t == NULL) {
    Py_XDECREF(detail);
    Py_XDECREF(kind);
    Py_XDECREF(reason);
    Py_XDECREF(handle);
    Py_XDECREF(t);
    /* out of memory: nothing will own the snapshot, so it goes now */
    if (snap != NULL) release_p(snap);
    return NULL;
  }
  PyTuple_SET_ITEM(t, 0, kind);
  PyTuple_SET_ITEM(t, 1, reason);
  PyTuple_SET_ITEM(t, 2, detail);
  PyTuple_SET_ITEM(t, 3, handle);
  return t;
}

/* Each of `seq` (a list or a tuple of exact ints, each at most `max`) into `out`; 0 when one is
 * not taken as is. */
static int ids(PyObject *seq, uint64_t max, uint64_t *out64, uint32_t *out32) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject **items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *x = items[i];
    if (!PyLong_CheckExact(x)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(x);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    if (v > max) return 0;
    if (out64 != NULL) out64[i] = (uint64_t)v;
    else out32[i] = (uint32_t)v;
  }
  return 1;
}

/* A non-negative exact int at most `max` into `*out`; 0 when not. */
static int small(PyObject *o, unsigned long long max, unsigned long long *out) {
  if (!PyLong_CheckExact(o)) return 0;
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
  if (v > max) return 0;
  *out = v;
  return 1;
}

/* submit(agent, endpoint, names, held, dst_blocks, deadline_ms, callbacks, out) -> status |
 * NotImplemented. `endpoint` exact bytes; `callbacks` the address of a kvrelay_fetch_callbacks
 * or 0; `out` the address of the fetch handle to write. */
static PyObject *fast_submit(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  (void)self;
  if (n != 8 || submit_p == NULL) return not_implemented();
  void *agent = address(args[0]);
  void *out = address(args[7]);
  PyObject *names = args[2], *dst = args[4];
  if (agent == NULL || out == NULL || !PyBytes_CheckExact(args[1])) return not_implemented();
  if (!(PyList_CheckExact(names) || PyTuple_CheckExact(names)) || !(PyList_CheckExact(dst) || PyTuple_CheckExact(dst)))
    return not_implemented();
  unsigned long long held, deadline, cbs;
  if (!small(args[3], SIZE_MAX, &held) || !small(args[5], UINT32_MAX, &deadline) || !small(args[6], UINTPTR_MAX, &cbs))
    return not_implemented();
  size_t nn = (size_t)PySequence_Fast_GET_SIZE(names), nd = (size_t)PySequence_Fast_GET_SIZE(dst);
  if (nd == 0 || deadline == 0 || held > nn || nd > nn - held) return not_implemented();
  uint64_t names_stack[STACK_IDS];
  uint32_t dst_stack[STACK_IDS];
  uint64_t *nv = nn <= STACK_IDS ? names_stack : malloc(nn * sizeof *nv);
  uint32_t *dv = nd <= STACK_IDS ? dst_stack : malloc(nd * sizeof *dv);
  PyObject *r;
  if (nv == NULL || dv == NULL) {
    r = PyErr_NoMemory();
  } else if (!ids(names, UINT64_MAX, nv, NULL) || !ids(dst, UINT32_MAX, NULL, dv)) {
    r = not_implemented();
  } else {
    struct kvrelay_fetch_params p;
    p.size = sizeof p;
    p.endpoint.ptr = PyBytes_AS_STRING(args[1]);
    p.endpoint.len = (size_t)PyBytes_GET_SIZE(args[1]);
    p.names = nv;
    p.names_len = nn;
    p.held = (size_t)held;
    p.dst_blocks = dv;
    p.dst_len = nd;
    p.deadline_ms = (uint32_t)deadline;
    kvrelay_status st = submit_p((const struct kvrelay_agent *)agent, &p,
                                 (const struct kvrelay_fetch_callbacks *)(uintptr_t)cbs, (struct kvrelay_fetch **)out);
    r = PyLong_FromLong((long)st);
  }
  if (nv != names_stack) free(nv);
  if (dv != dst_stack) free(dv);
  return r;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))fast_bind, METH_FASTCALL, "bind(admit, submit, release): the library's functions"},
    {"admit", (PyCFunction)(void (*)(void))fast_admit, METH_FASTCALL, "kvrelay_admit, or NotImplemented"},
    {"submit", (PyCFunction)(void (*)(void))fast_submit, METH_FASTCALL, "kvrelay_agent_submit, or NotImplemented"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvrelay._fast", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast(void) {
  if (PyType_Ready(&SnapRefType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&SnapRefType);
  if (PyModule_AddObject(m, "SnapshotRef", (PyObject *)&SnapRefType) < 0) {
    Py_DECREF(&SnapRefType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
