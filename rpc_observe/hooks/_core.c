/* rpc_observe.hooks._core: the per-call core in C, first part: the trailer codec.
 *
 * Every RPC message crosses this code (hooks/trailer.py has the layout, and the Python
 * reference of each function here, which tests/unit/test_trailer.py holds these to on the
 * same bytes, hostile ones included).  It reads bytes a peer sent, so it trusts nothing:
 * every length is checked against the buffer before a byte is read, nothing is written
 * outside what it allocated, and a trailer it does not accept gives None (the Python
 * general path then counts it and goes on).  Built when a C compiler is there
 * (hatch_build.py); RPC_OBSERVE_NO_EXTENSIONS=1 runs the Python reference instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAGIC "\x00rpcobs1"
#define MAGIC_SIZE 8
#define LENGTH_SIZE 2
#define OVERHEAD (MAGIC_SIZE + LENGTH_SIZE)
#define MAX_PAYLOAD 2048
#define MAX_CALL_ID_DIGITS 20
#define SEP '\x1f'
/* The longest decimal number a long long holds in full: 18 digits (19 may overflow). */
#define SAFE_DIGITS 18

static PyObject *sep_str;  /* "\x1f" */

/* A decimal number of 1..MAX_CALL_ID_DIGITS ASCII digits as an int; NULL (no error set) if it is not one. */
static PyObject *
digits_to_int(const char *s, Py_ssize_t n)
{
    if (n < 1 || n > MAX_CALL_ID_DIGITS) {
        return NULL;
    }
    long long value = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') {
            return NULL;
        }
        if (i < SAFE_DIGITS) {
            value = value * 10 + (s[i] - '0');
        }
    }
    if (n <= SAFE_DIGITS) {
        return PyLong_FromLongLong(value);
    }
    char text[MAX_CALL_ID_DIGITS + 1];  /* PyLong_FromString wants a terminated string */
    memcpy(text, s, (size_t)n);
    text[n] = '\0';
    return PyLong_FromString(text, NULL, 10);
}

/* True if s[0:n] is empty or a number of at most MAX_CALL_ID_DIGITS ASCII digits (trailer.valid_call_id). */
static int
valid_call_id(const char *s, Py_ssize_t n)
{
    if (n > MAX_CALL_ID_DIGITS) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') {
            return 0;
        }
    }
    return 1;
}

/* A response's payload after "r\x1f": `call id[\x1f callee us]` -> (pickle size, call id, callee us or -1). */
static PyObject *
parse_response(const char *p, Py_ssize_t n, Py_ssize_t pickle_size)
{
    const char *sep = memchr(p, SEP, (size_t)n);
    Py_ssize_t id_len = sep != NULL ? sep - p : n;
    PyObject *call_id = digits_to_int(p, id_len);  /* empty: no call to end, the general path's business */
    if (call_id == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    PyObject *callee;
    if (sep == NULL || id_len + 1 == n) {  /* no callee time, or an empty one */
        callee = PyLong_FromLong(-1);
    }
    else {
        callee = digits_to_int(sep + 1, n - id_len - 1);  /* a second separator is not a digit: refused */
    }
    if (callee == NULL) {
        Py_DECREF(call_id);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    PyObject *size = PyLong_FromSsize_t(pickle_size);
    if (size == NULL) {
        Py_DECREF(call_id);
        Py_DECREF(callee);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(3, size, call_id, callee);
    Py_DECREF(size);
    Py_DECREF(call_id);
    Py_DECREF(callee);
    return result;
}

/* A request's payload (UTF-8, fields split by 0x1f) -> (pickle size, fields); None if it is not a valid one. */
static PyObject *
parse_request(const char *p, Py_ssize_t n, Py_ssize_t pickle_size)
{
    PyObject *text = PyUnicode_DecodeUTF8(p, n, "strict");
    if (text == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            return NULL;
        }
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *fields = PyUnicode_Split(text, sep_str, -1);
    Py_DECREF(text);
    if (fields == NULL) {
        return NULL;
    }
    /* kind, src, mode, call id, context...: the call id empty or digits */
    if (PyList_GET_SIZE(fields) < 4) {
        Py_DECREF(fields);
        Py_RETURN_NONE;
    }
    Py_ssize_t id_len;
    const char *id = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(fields, 3), &id_len);
    if (id == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    if (!valid_call_id(id, id_len)) {
        Py_DECREF(fields);
        Py_RETURN_NONE;
    }
    PyObject *size = PyLong_FromSsize_t(pickle_size);
    if (size == NULL) {
        Py_DECREF(fields);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, size, fields);
    Py_DECREF(size);
    Py_DECREF(fields);
    return result;
}

PyDoc_STRVAR(parse_doc,
"parse(data, /)\n--\n\n"
"What the pickler's fast paths take from a message: (pickle size, call id, callee us or -1) of a response\n"
"that echoes a call id, (pickle size, fields) of a request; None for anything else (no trailer, a\n"
"malformed one, a response without a call id). trailer.parse is its Python reference.");

static PyObject *
parse(PyObject *module, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const char *buf = view.buf;
    Py_ssize_t len = view.len;
    PyObject *result = NULL;
    if (len < OVERHEAD || memcmp(buf + len - MAGIC_SIZE, MAGIC, MAGIC_SIZE) != 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const unsigned char *length = (const unsigned char *)buf + len - OVERHEAD;
    Py_ssize_t size = (Py_ssize_t)length[0] | ((Py_ssize_t)length[1] << 8);
    if (size > MAX_PAYLOAD || size + OVERHEAD > len || size < 2 || buf[len - OVERHEAD - size + 1] != SEP) {
        result = Py_NewRef(Py_None);  /* too long, longer than the message, or not `kind \x1f ...` */
        goto done;
    }
    const char *payload = buf + len - OVERHEAD - size;
    Py_ssize_t pickle_size = len - OVERHEAD - size;
    if (payload[0] == 'r') {
        result = parse_response(payload + 2, size - 2, pickle_size);
    }
    else if (payload[0] == 'q') {
        result = parse_request(payload, size, pickle_size);
    }
    else {
        result = Py_NewRef(Py_None);
    }
done:
    PyBuffer_Release(&view);
    return result;
}

/* `text` as UTF-8, lone surrogates replaced (str.encode("utf-8", "replace")): a new bytes object. */
static PyObject *
utf8(PyObject *text)
{
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    return PyUnicode_AsEncodedString(text, "utf-8", "replace");
}

/* payload (cut to MAX_PAYLOAD) + its length (2 bytes, little endian) + MAGIC; `parts` are bytes objects. */
static PyObject *
pack(PyObject *const *parts, int count)
{
    Py_ssize_t size = 0;
    for (int i = 0; i < count; i++) {
        size += PyBytes_GET_SIZE(parts[i]);
    }
    if (size > MAX_PAYLOAD) {
        size = MAX_PAYLOAD;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size + OVERHEAD);
    if (out == NULL) {
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
    Py_ssize_t left = size;
    for (int i = 0; i < count && left > 0; i++) {
        Py_ssize_t n = PyBytes_GET_SIZE(parts[i]);
        if (n > left) {
            n = left;
        }
        memcpy(w, PyBytes_AS_STRING(parts[i]), (size_t)n);
        w += n;
        left -= n;
    }
    w[0] = (char)(size & 0xff);
    w[1] = (char)(size >> 8);
    memcpy(w + LENGTH_SIZE, MAGIC, MAGIC_SIZE);
    return out;
}

/* str(number) as bytes: the call id and the callee's time (any int, as str() writes it). */
static PyObject *
decimal(PyObject *number)
{
    PyObject *text = PyObject_Str(number);
    if (text == NULL) {
        return NULL;
    }
    PyObject *bytes = PyUnicode_AsUTF8String(text);
    Py_DECREF(text);
    return bytes;
}

PyDoc_STRVAR(request_trailer_doc,
"request_trailer(head, call_id, context, /)\n--\n\n"
"trailer.request_trailer: `head`, the call id (0: none), SEP and `context` (if any), packed.");

static PyObject *
request_trailer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyLong_Check(args[1]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "request_trailer(head: str, call_id: int, context: str)");
        return NULL;
    }
    PyObject *parts[4] = {NULL, NULL, NULL, NULL};
    int count = 0;
    PyObject *result = NULL;
    if ((parts[count++] = utf8(args[0])) == NULL) {
        goto done;
    }
    int nonzero = PyObject_IsTrue(args[1]);
    if (nonzero < 0) {
        goto done;
    }
    if (nonzero && (parts[count++] = decimal(args[1])) == NULL) {
        goto done;
    }
    if (PyUnicode_GET_LENGTH(args[2]) > 0) {
        if ((parts[count++] = PyBytes_FromStringAndSize("\x1f", 1)) == NULL ||
            (parts[count++] = utf8(args[2])) == NULL) {
            goto done;
        }
    }
    result = pack(parts, count);
done:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(parts[i]);
    }
    return result;
}

PyDoc_STRVAR(response_trailer_doc,
"response_trailer(call_id, callee_us, /)\n--\n\n"
"trailer.response_trailer: `r`, the echoed call id and, if >= 0, the callee's time in us, packed.");

static PyObject *
response_trailer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "response_trailer(call_id: str, callee_us: int)");
        return NULL;
    }
    PyObject *parts[4] = {NULL, NULL, NULL, NULL};
    int count = 0;
    PyObject *result = NULL;
    if ((parts[count++] = PyBytes_FromStringAndSize("r\x1f", 2)) == NULL ||
        (parts[count++] = utf8(args[0])) == NULL) {
        goto done;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        goto done;
    }
    int timed = PyObject_RichCompareBool(args[1], zero, Py_GE);
    Py_DECREF(zero);
    if (timed < 0) {
        goto done;
    }
    if (timed) {
        if ((parts[count++] = PyBytes_FromStringAndSize("\x1f", 1)) == NULL ||
            (parts[count++] = decimal(args[1])) == NULL) {
            goto done;
        }
    }
    result = pack(parts, count);
done:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(parts[i]);
    }
    return result;
}

static PyMethodDef core_methods[] = {
    {"parse", parse, METH_O, parse_doc},
    {"request_trailer", (PyCFunction)(void (*)(void))request_trailer, METH_FASTCALL, request_trailer_doc},
    {"response_trailer", (PyCFunction)(void (*)(void))response_trailer, METH_FASTCALL, response_trailer_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "The per-call core in C: the trailer codec (see trailer.py).", -1, core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (sep_str == NULL && (sep_str = PyUnicode_FromStringAndSize("\x1f", 1)) == NULL) {
        return NULL;
    }
    return PyModule_Create(&core_module);
}
