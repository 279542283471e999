/* Trace and span ids as lower-case hex, shared by the C modules that write them (hooks/_core.c: the traceparent
 * entry; telemetry/_spanjson.c: the span files). An id is a Python int; only an exact int in range is written,
 * anything else is left to the Python code (whose %-format is the reference). Included, not linked: each module
 * is built alone (hatch_build.py). */
#ifndef RPC_OBSERVE_IDS_H
#define RPC_OBSERVE_IDS_H

#include <Python.h>

/* An exact int in [0, 2**(8 * count)) as `count` big-endian bytes (count 8 or 16): 1; anything else: 0, no error. */
static int
id_bytes(PyObject *v, unsigned char *out, int count)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
    if (count == 8) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();  /* negative or too big */
            return 0;
        }
        for (int i = 7; i >= 0; i--, u >>= 8) {
            out[i] = (unsigned char)(u & 0xff);
        }
        return 1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t needed = PyLong_AsNativeBytes(v, out, count, Py_ASNATIVEBYTES_BIG_ENDIAN |
                                             Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (needed < 0) {
        PyErr_Clear();
        return 0;
    }
    return needed <= count;
#else
    if (_PyLong_AsByteArray((PyLongObject *)v, out, (size_t)count, 0, 0) < 0) {
        PyErr_Clear();  /* negative or too big */
        return 0;
    }
    return 1;
#endif
}

/* An id as 2 * count hex digits into `out` (Python's "%0{2 * count}x" of it): 1, else 0 (nothing written). */
static int
id_hex(PyObject *v, char *out, int count)
{
    static const char digits[] = "0123456789abcdef";
    unsigned char bytes[16];
    if (count > 16 || !id_bytes(v, bytes, count)) {
        return 0;
    }
    for (int i = 0; i < count; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    return 1;
}

#endif
