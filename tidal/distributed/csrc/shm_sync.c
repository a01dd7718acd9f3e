/* Memory ordering and futex waits on a shared-memory segment, for
 * tidal/distributed/shm_queue.py.
 *
 * Python cannot order its loads and stores: a flag written through a memoryview may
 * become visible to another core before the payload it guards (ARM), and nothing stops
 * the store of "written" from passing a later load of "is a reader asleep?" (x86 too).
 * These helpers give the queue real C11 atomics on 32-bit words of the segment, named
 * by absolute address (the caller keeps the mapping alive), and the futex the readers
 * sleep on. Each call is one instruction or one syscall; futex_wait releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int word_at(PyObject *arg, uint32_t **out) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (addr == 0 || (addr & 3u)) {
        PyErr_SetString(PyExc_ValueError, "address must be a non-null 4-byte aligned address");
        return -1;
    }
    *out = (uint32_t *)(uintptr_t)addr;
    return 0;
}

static int u32_arg(PyObject *arg, uint32_t *out) {
    unsigned long v = PyLong_AsUnsignedLong(arg);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (v > 0xffffffffUL) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* load_acquire(addr) -> int: later reads see what the writer wrote before its release. */
static PyObject *load_acquire(PyObject *self, PyObject *arg) {
    uint32_t *p;
    if (word_at(arg, &p)) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

/* store_release(addr, value): earlier writes become visible no later than this one. */
static PyObject *store_release(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    uint32_t *p, v;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "store_release(addr, value)");
        return NULL;
    }
    if (word_at(args[0], &p) || u32_arg(args[1], &v)) return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* store_seq_cst(addr, value): a release store that no later load may pass (the store
 * then load of a sleep/wake handshake). */
static PyObject *store_seq_cst(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    uint32_t *p, v;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "store_seq_cst(addr, value)");
        return NULL;
    }
    if (word_at(args[0], &p) || u32_arg(args[1], &v)) return NULL;
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* load_seq_cst(addr) -> int */
static PyObject *load_seq_cst(PyObject *self, PyObject *arg) {
    uint32_t *p;
    if (word_at(arg, &p)) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_SEQ_CST));
}

/* futex_wait(addr, expected, timeout_s) -> 0 woken (or spurious), 1 timed out, 2 the
 * word no longer held ``expected``. The GIL is released while asleep. The futex is
 * not private: the waker is another process mapping the same segment. */
static PyObject *futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    uint32_t *p, expected;
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "futex_wait(addr, expected, timeout_s)");
        return NULL;
    }
    if (word_at(args[0], &p) || u32_arg(args[1], &expected)) return NULL;
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, p, FUTEX_WAIT, expected, &ts, NULL, 0);
    if (rc != 0) err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0 || err == EINTR) return PyLong_FromLong(0);
    if (err == ETIMEDOUT) return PyLong_FromLong(1);
    if (err == EAGAIN) return PyLong_FromLong(2);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* futex_wake(addr, count) -> number of waiters woken. */
static PyObject *futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    uint32_t *p, count;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "futex_wake(addr, count)");
        return NULL;
    }
    if (word_at(args[0], &p) || u32_arg(args[1], &count)) return NULL;
    long rc = syscall(SYS_futex, p, FUTEX_WAKE, count > 0x7fffffffu ? 0x7fffffffu : count,
                      NULL, NULL, 0);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"load_acquire", (PyCFunction)load_acquire, METH_O, "acquire load of a u32"},
    {"load_seq_cst", (PyCFunction)load_seq_cst, METH_O, "sequentially consistent u32 load"},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL,
     "release store of a u32"},
    {"store_seq_cst", (PyCFunction)(void (*)(void))store_seq_cst, METH_FASTCALL,
     "sequentially consistent u32 store"},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_FASTCALL,
     "sleep while the u32 holds a value"},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_FASTCALL,
     "wake sleepers of a u32"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shm_sync",
    "C11 atomics and futexes on shared-memory words (tidal/distributed/shm_queue.py)", -1,
    methods,
};

PyMODINIT_FUNC PyInit__shm_sync(void) { return PyModule_Create(&module); }
