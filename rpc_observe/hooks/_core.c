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
#include <structmember.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/random.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

#include "../_ids.h"

#define MAGIC "\x00rpcobs1"
#define MAGIC_SIZE 8
#define LENGTH_SIZE 2
#define OVERHEAD (MAGIC_SIZE + LENGTH_SIZE)
#define MAX_PAYLOAD 2048
#define MAX_CALL_ID_DIGITS 20
#define SEP '\x1f'
/* The longest decimal number a long long holds in full: 18 digits (19 may overflow). */
#define SAFE_DIGITS 18

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

/* What a message's trailer says, read without building the tuple `parse` returns. */
enum kind { NONE, RESPONSE, REQUEST, FAILED };

typedef struct {
    Py_ssize_t pickle_size;
    PyObject *call_id;  /* RESPONSE: the echoed call id (new reference) */
    long long callee_us;  /* RESPONSE: -1 if not given */
    PyObject *fields;  /* REQUEST: the fields (new reference) */
} trailer_view;

/* A response's payload after "r\x1f": `call id[\x1f callee us]`. NONE if it is not a valid one with a call id. */
static enum kind
read_response(const char *p, Py_ssize_t n, trailer_view *out)
{
    const char *sep = memchr(p, SEP, (size_t)n);
    Py_ssize_t id_len = sep != NULL ? sep - p : n;
    long long callee = -1;
    if (sep != NULL && id_len + 1 < n) {  /* a callee time */
        Py_ssize_t c_len = n - id_len - 1;
        if (c_len > MAX_CALL_ID_DIGITS) {
            return NONE;
        }
        PyObject *number = digits_to_int(sep + 1, c_len);  /* a second separator is not a digit: refused */
        if (number == NULL) {
            return PyErr_Occurred() ? FAILED : NONE;
        }
        callee = PyLong_AsLongLong(number);
        Py_DECREF(number);
        if (callee == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return FAILED;
            }
            PyErr_Clear();
        }
        if (c_len > SAFE_DIGITS) {  /* 19-20 digits: no real call, taken as not known (trailer.parse alike) */
            callee = -1;
        }
    }
    out->call_id = digits_to_int(p, id_len);  /* empty: no call to end, the general path's business */
    if (out->call_id == NULL) {
        return PyErr_Occurred() ? FAILED : NONE;
    }
    out->callee_us = callee;
    return RESPONSE;
}

/* The text a request's head repeats (its kind, the caller's name, its mode) as the same object for the same bytes, so
 * that a request makes no string for them (and their hashes, which the site lookup reads, are already known):
 * direct-mapped by an FNV-1a hash of the bytes, each held until other bytes take its entry. NULL with an error; a
 * UnicodeDecodeError for bytes that are not UTF-8, as decoding them does. */
#define HEAD_STRINGS 64
#define HEAD_STRING_MAX 64  /* longer: decoded each time */
static PyObject *head_strings[HEAD_STRINGS];

static PyObject *
head_string(const char *p, Py_ssize_t n)
{
    if (n > HEAD_STRING_MAX) {
        return PyUnicode_DecodeUTF8(p, n, "strict");
    }
    uint64_t hash = 14695981039346656037ULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        hash = (hash ^ (unsigned char)p[i]) * 1099511628211ULL;
    }
    PyObject **entry = &head_strings[hash % HEAD_STRINGS], *text = *entry;
    if (text != NULL) {
        Py_ssize_t size;
        const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);  /* ASCII: its data; else made once, kept */
        if (utf8 != NULL && size == n && memcmp(utf8, p, (size_t)n) == 0) {
            return Py_NewRef(text);
        }
        PyErr_Clear();  /* no memory for the UTF-8 copy: a miss */
    }
    if ((text = PyUnicode_DecodeUTF8(p, n, "strict")) != NULL) {
        Py_XSETREF(*entry, Py_NewRef(text));
    }
    return text;
}

/* A request's payload (UTF-8, fields split by 0x1f: as the payload decoded and split, since 0x1f is never part of
 * a multi-byte character). NONE if it is not a valid one. */
static enum kind
read_request(const char *p, Py_ssize_t n, trailer_view *out)
{
    Py_ssize_t count = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        count += p[i] == SEP;
    }
    if (count < 4) {  /* kind, src, mode, call id, context...: the call id empty or digits */
        return NONE;
    }
    PyObject *fields = PyList_New(count);
    if (fields == NULL) {
        return FAILED;
    }
    const char *at = p, *end = p + n;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *sep = memchr(at, SEP, (size_t)(end - at));
        Py_ssize_t size = (sep != NULL ? sep : end) - at;
        if (i == 3 && !valid_call_id(at, size)) {
            Py_DECREF(fields);
            return NONE;
        }
        PyObject *field = i < 3 ? head_string(at, size) : PyUnicode_DecodeUTF8(at, size, "strict");
        if (field == NULL) {
            Py_DECREF(fields);
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                return FAILED;
            }
            PyErr_Clear();
            return NONE;
        }
        PyList_SET_ITEM(fields, i, field);
        at = sep != NULL ? sep + 1 : end;
    }
    out->fields = fields;
    return REQUEST;
}

/* The trailer of `buf[0:len]`: every length is checked against the buffer before a byte is read. */
static enum kind
read_trailer(const char *buf, Py_ssize_t len, trailer_view *out)
{
    out->call_id = out->fields = NULL;
    if (len < OVERHEAD || memcmp(buf + len - MAGIC_SIZE, MAGIC, MAGIC_SIZE) != 0) {
        return NONE;
    }
    const unsigned char *length = (const unsigned char *)buf + len - OVERHEAD;
    Py_ssize_t size = (Py_ssize_t)length[0] | ((Py_ssize_t)length[1] << 8);
    if (size > MAX_PAYLOAD || size + OVERHEAD > len || size < 2 || buf[len - OVERHEAD - size + 1] != SEP) {
        return NONE;  /* too long, longer than the message, or not `kind \x1f ...` */
    }
    const char *payload = buf + len - OVERHEAD - size;
    out->pickle_size = len - OVERHEAD - size;
    if (payload[0] == 'r') {
        return read_response(payload + 2, size - 2, out);
    }
    if (payload[0] == 'q') {
        return read_request(payload, size, out);
    }
    return NONE;
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
    trailer_view t;
    enum kind kind = read_trailer(view.buf, view.len, &t);
    PyObject *result = NULL;
    if (kind == RESPONSE) {
        PyObject *callee = PyLong_FromLongLong(t.callee_us);
        result = callee != NULL ? Py_BuildValue("(nOO)", t.pickle_size, t.call_id, callee) : NULL;
        Py_XDECREF(callee);
        Py_DECREF(t.call_id);
    }
    else if (kind == REQUEST) {
        result = Py_BuildValue("(nO)", t.pickle_size, t.fields);
        Py_DECREF(t.fields);
    }
    else if (kind == NONE) {
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

/* A piece of a trailer's payload: `n` bytes at `p`, kept alive by `owner` (a new reference, or NULL when `p` is
 * held by an object the caller holds, or by the caller's own buffer). Packing reads the pieces where they are, so
 * a trailer makes one bytes object, not one per piece. */
typedef struct {
    const char *p;
    Py_ssize_t n;
    PyObject *owner;
} piece;

/* `text` as UTF-8, lone surrogates replaced (str.encode("utf-8", "replace")): the str's own UTF-8 (kept on it by
 * CPython; an ASCII str's is its data) where it has one, else a new bytes object. 0, or -1 with an error. */
static int
utf8(PyObject *text, piece *out)
{
    out->owner = NULL;
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(text)->tp_name);
        return -1;
    }
    if ((out->p = PyUnicode_AsUTF8AndSize(text, &out->n)) != NULL) {
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        return -1;
    }
    PyErr_Clear();  /* lone surrogates: encoded with "replace", as the Python reference does */
    if ((out->owner = PyUnicode_AsEncodedString(text, "utf-8", "replace")) == NULL) {
        return -1;
    }
    out->p = PyBytes_AS_STRING(out->owner), out->n = PyBytes_GET_SIZE(out->owner);
    return 0;
}

/* str(number) as bytes: the call id and the callee's time (any int, as str() writes it). An exact int that fits a
 * long long is written into `digits` (at least 21 bytes); anything else goes through str(). 0, or -1 with an
 * error. */
static int
decimal(PyObject *number, char *digits, piece *out)
{
    out->owner = NULL;
    if (PyLong_CheckExact(number)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (!overflow) {
            unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
            char *end = digits + 21, *w = end;
            do {
                *--w = (char)('0' + magnitude % 10);
                magnitude /= 10;
            } while (magnitude > 0);
            if (value < 0) {
                *--w = '-';
            }
            out->p = w, out->n = end - w;
            return 0;
        }
    }
    PyObject *text = PyObject_Str(number);
    if (text == NULL) {
        return -1;
    }
    out->owner = PyUnicode_AsUTF8String(text);
    Py_DECREF(text);
    if (out->owner == NULL) {
        return -1;
    }
    out->p = PyBytes_AS_STRING(out->owner), out->n = PyBytes_GET_SIZE(out->owner);
    return 0;
}

/* `prefix` (a message, or nothing) + payload (`pieces`, cut to MAX_PAYLOAD) + its length (2 bytes, little
 * endian) + MAGIC, in one new bytes object; `*payload_size` (if given) gets the payload's size. */
static PyObject *
pack(const char *prefix, Py_ssize_t prefix_size, const piece *pieces, int count, Py_ssize_t *payload_size)
{
    Py_ssize_t size = 0;
    for (int i = 0; i < count; i++) {
        size += pieces[i].n;
    }
    if (size > MAX_PAYLOAD) {
        size = MAX_PAYLOAD;
    }
    if (prefix_size > PY_SSIZE_T_MAX - size - OVERHEAD) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, prefix_size + size + OVERHEAD);
    if (out == NULL) {
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
    if (prefix_size > 0) {
        memcpy(w, prefix, (size_t)prefix_size);
        w += prefix_size;
    }
    Py_ssize_t left = size;
    for (int i = 0; i < count && left > 0; i++) {
        Py_ssize_t n = pieces[i].n < left ? pieces[i].n : left;
        memcpy(w, pieces[i].p, (size_t)n);
        w += n;
        left -= n;
    }
    w[0] = (char)(size & 0xff);
    w[1] = (char)(size >> 8);
    memcpy(w + LENGTH_SIZE, MAGIC, MAGIC_SIZE);
    if (payload_size != NULL) {
        *payload_size = size;
    }
    return out;
}

static void
release_pieces(piece *pieces, int count)
{
    for (int i = 0; i < count; i++) {
        Py_CLEAR(pieces[i].owner);
    }
}

static const piece SEP_PIECE = {"\x1f", 1, NULL};

PyDoc_STRVAR(request_trailer_doc,
"request_trailer(head, call_id, context, /)\n--\n\n"
"trailer.request_trailer: `head`, the call id (0: none), SEP and `context` (if any), packed.");

/* `prefix` + the trailer of a request: `head`, the call id (0: none), SEP and `context` (if not empty). */
static PyObject *
pack_request(const char *prefix, Py_ssize_t prefix_size, PyObject *head, PyObject *call_id, PyObject *context,
             Py_ssize_t *payload_size)
{
    if (!PyLong_Check(call_id) || !PyUnicode_Check(context)) {
        PyErr_SetString(PyExc_TypeError, "request_trailer(head: str, call_id: int, context: str)");
        return NULL;
    }
    piece pieces[4];
    char digits[21];
    int count = 0;
    PyObject *result = NULL;
    if (utf8(head, &pieces[count]) < 0) {
        goto done;
    }
    count++;
    int nonzero = PyObject_IsTrue(call_id);
    if (nonzero < 0) {
        goto done;
    }
    if (nonzero) {
        if (decimal(call_id, digits, &pieces[count]) < 0) {
            goto done;
        }
        count++;
    }
    if (PyUnicode_GET_LENGTH(context) > 0) {
        pieces[count++] = SEP_PIECE;
        if (utf8(context, &pieces[count]) < 0) {
            goto done;
        }
        count++;
    }
    result = pack(prefix, prefix_size, pieces, count, payload_size);
done:
    release_pieces(pieces, count);
    return result;
}

static PyObject *
request_trailer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "request_trailer(head: str, call_id: int, context: str)");
        return NULL;
    }
    return pack_request(NULL, 0, args[0], args[1], args[2], NULL);
}

PyDoc_STRVAR(response_trailer_doc,
"response_trailer(call_id, callee_us, /)\n--\n\n"
"trailer.response_trailer: `r`, the echoed call id and, if >= 0, the callee's time in us, packed.");

/* `prefix` + the trailer of a response: `r`, the echoed call id and, if >= 0, the callee's time in us. */
static PyObject *
pack_response(const char *prefix, Py_ssize_t prefix_size, PyObject *call_id, PyObject *callee_us)
{
    if (!PyLong_Check(callee_us)) {
        PyErr_SetString(PyExc_TypeError, "response_trailer(call_id: str, callee_us: int)");
        return NULL;
    }
    piece pieces[4] = {{"r\x1f", 2, NULL}};
    char digits[21];
    int count = 1;
    PyObject *result = NULL;
    if (utf8(call_id, &pieces[count]) < 0) {
        goto done;
    }
    count++;
    int timed;
    if (PyLong_CheckExact(callee_us)) {  /* callee_us >= 0 without an int object for 0 */
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(callee_us, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            goto done;
        }
        timed = overflow > 0 || (!overflow && value >= 0);
    }
    else {
        PyObject *zero = PyLong_FromLong(0);
        timed = zero != NULL ? PyObject_RichCompareBool(callee_us, zero, Py_GE) : -1;
        Py_XDECREF(zero);
        if (timed < 0) {
            goto done;
        }
    }
    if (timed) {
        pieces[count++] = SEP_PIECE;
        if (decimal(callee_us, digits, &pieces[count]) < 0) {
            goto done;
        }
        count++;
    }
    result = pack(prefix, prefix_size, pieces, count, NULL);
done:
    release_pieces(pieces, count);
    return result;
}

static PyObject *
response_trailer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "response_trailer(call_id: str, callee_us: int)");
        return NULL;
    }
    return pack_response(NULL, 0, args[0], args[1]);
}

/* ---- The pickler's hot path: what `pickler.deserialize` does after torch unpickled a message ---- */

/* What `configure` hands over once: the tables and functions the hot path uses (strong references). */
static struct {
    PyObject *in_flight;  /* calls.in_flight */
    PyObject *finished;  /* calls.finished: a FinishedCalls (or its reference, appended to) */
    PyObject *fold_message, *fold_split, *fold_finished;  /* the metrics' fold functions, first in each record */
    PyObject *remote_exception;  /* torch's RemoteException type */
    PyObject *python_udf;  /* torch's PythonUDF type */
    PyObject *request_cells;  /* pickler._request_cells(runtime, func, args) */
    PyObject *finish_call;  /* pickler._finish_echoed(call, obj, end_ns, callee_ns): the reference ending */
    PyObject *not_handled;  /* what `handle` returns for the general path */
    PyObject *time_ns;  /* time.time_ns (a test's clock in tests) */
    PyObject *next_id;  /* calls.next_id */
    Py_ssize_t max_in_flight;  /* calls.MAX_IN_FLIGHT */
} refs;
static PyObject *id_counter;  /* the itertools.count whose __next__ refs.next_id is, or NULL */

/* The client call whose request is being sent on this thread (a strong reference), or NULL: set by the invoke hook
 * (and client.py's remote) around torch's call, read where the request is pickled, on the same thread. A C thread
 * local, where threading.local takes three dict lookups a read. Never left set when a thread ends: the setters put
 * back what was there on every path. */
static __thread PyObject *thread_call;

PyDoc_STRVAR(current_call_doc,
"current_call()\n--\n\n"
"The client call whose request this thread is sending, or None (calls.current_call).");

static PyObject *
current_call(PyObject *module, PyObject *unused)
{
    return Py_NewRef(thread_call != NULL ? thread_call : Py_None);
}

PyDoc_STRVAR(set_current_call_doc,
"set_current_call(call, /)\n--\n\n"
"Makes `call` (None: none) the client call this thread is sending (calls.set_current_call).");

static PyObject *
set_current_call(PyObject *module, PyObject *call)
{
    Py_XSETREF(thread_call, call != Py_None ? Py_NewRef(call) : NULL);
    Py_RETURN_NONE;
}

/* The reply this thread owes (calls.pending_replies is its reference): the site of the UDF it ran, the caller's call
 * id text ("": no echo) and the request's start (perf_counter; 0.0: not known), set where the run ends and taken
 * where its response is pickled, next on the same thread (torch pickles a UDF's response where it ran it). site NULL:
 * none. A C thread local, where a dict keyed by thread id takes an int, a tuple and two lookups a reply. */
static __thread struct {
    PyObject *site, *echo;  /* strong */
    double request_start;
} pending_reply;

/* Owes this reply now (references added); what was owed before is dropped (its UDF's response never came here). */
static void
owe_reply(PyObject *site, PyObject *echo, double request_start)
{
    PyObject *old_site = pending_reply.site, *old_echo = pending_reply.echo;
    pending_reply.site = Py_NewRef(site);
    pending_reply.echo = Py_NewRef(echo);
    pending_reply.request_start = request_start;
    Py_XDECREF(old_site);
    Py_XDECREF(old_echo);
}

/* Takes the reply owed (its references move to the caller): 1, or 0 if none. */
static int
take_reply(PyObject **site, PyObject **echo, double *request_start)
{
    if (pending_reply.site == NULL) {
        return 0;
    }
    *site = pending_reply.site, *echo = pending_reply.echo, *request_start = pending_reply.request_start;
    pending_reply.site = pending_reply.echo = NULL;
    return 1;
}

PyDoc_STRVAR(set_pending_reply_doc,
"set_pending_reply(site, echo, request_start, /)\n--\n\n"
"This thread owes the reply of the UDF it ran (calls.set_pending_reply).");

static PyObject *
set_pending_reply(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    double request_start = nargs == 3 ? PyFloat_AsDouble(args[2]) : -1.0;
    if (nargs != 3 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_pending_reply(site, echo: str, request_start: float)");
        return NULL;
    }
    if (request_start == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    owe_reply(args[0], args[1], request_start);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_pending_reply_doc,
"take_pending_reply()\n--\n\n"
"The reply this thread owes, taken: (site, echo, request start), or None (calls.take_pending_reply).");

static PyObject *
take_pending_reply(PyObject *module, PyObject *unused)
{
    PyObject *site, *echo;
    double request_start;
    if (!take_reply(&site, &echo, &request_start)) {
        Py_RETURN_NONE;
    }
    PyObject *reply = Py_BuildValue("(OOd)", site, echo, request_start);
    Py_DECREF(site);
    Py_DECREF(echo);
    return reply;
}

/* ---- What each thread serves: the UDF it runs (calls.serving) and the SERVER span its own RPCs are children of
 * (Tracer.serving, without a TracerProvider); a dict by thread id is the reference of each ----
 * Both are read by other threads (the flight recorder; a nested call's parent) and written by every pool thread at
 * every run: a slot per thread in C, where the dicts took a thread id int, a tuple, a start int and four writes of
 * tables every pool thread shares. Slots live in one list, changed and read under the GIL only; a thread finds its
 * own through a thread local. A slot is never freed: an ended thread's empty slot is taken by the next thread that
 * needs one, so there are at most as many as threads alive at once (plus entries set by hand for an id no thread
 * has). `_core.serving` and `_core.serving_spans` are the dict-like views of the two tables. */
/* A UDF entry: (site, call id, start ns, trace id), as calls.Served. */
typedef struct {
    PyObject *site, *call_id, *trace_id;  /* strong; site NULL: none */
    long long start_ns;
} served_entry;

typedef struct serving_slot {
    struct serving_slot *next;
    unsigned long thread;
    int adopted;  /* a thread's own (its thread local points here) */
    int owner_gone;  /* that thread ended (set by its pthread key's destructor, without the GIL: atomic) */
    served_entry udf;
    PyObject *span;  /* strong; NULL: no span entry */
} serving_slot;

static serving_slot *serving_slots;
static __thread serving_slot *thread_slot;
static int foreign_slots;  /* a value was set by hand for another thread: a thread without a slot may have one */
static pthread_key_t slot_key;
static int slot_key_made;

static void
slot_owner_ended(void *slot)
{
    __atomic_store_n(&((serving_slot *)slot)->owner_gone, 1, __ATOMIC_RELEASE);
}

static int
slot_empty(serving_slot *s)
{
    return s->udf.site == NULL && s->span == NULL;
}

static int
slot_free(serving_slot *s)
{
    return slot_empty(s) && (!s->adopted || __atomic_load_n(&s->owner_gone, __ATOMIC_ACQUIRE));
}

/* The slot of `thread` (the dicts' key), or NULL. */
static serving_slot *
slot_find(unsigned long thread)
{
    for (serving_slot *s = serving_slots; s != NULL; s = s->next) {
        if (s->thread == thread && !(s->adopted && slot_free(s))) {
            return s;
        }
    }
    return NULL;
}

/* A slot for `thread`: its own, a free one renamed, or a new one; NULL with MemoryError. */
static serving_slot *
slot_make(unsigned long thread)
{
    serving_slot *s = slot_find(thread);
    for (serving_slot *f = serving_slots; s == NULL && f != NULL; f = f->next) {
        if (slot_free(f)) {
            s = f;
            s->adopted = 0;
            s->thread = thread;
        }
    }
    if (s == NULL) {
        if ((s = PyMem_RawCalloc(1, sizeof(serving_slot))) == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        s->thread = thread;
        s->next = serving_slots;  /* newest first; readers order entries by their start */
        serving_slots = s;
    }
    return s;
}

/* This thread's slot, adopted the first time (its ended-thread destructor registered); NULL with an error. */
static serving_slot *
own_slot(void)
{
    if (thread_slot != NULL) {
        return thread_slot;
    }
    if (!slot_key_made) {
        if (pthread_key_create(&slot_key, slot_owner_ended) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "pthread_key_create failed");
            return NULL;
        }
        slot_key_made = 1;
    }
    serving_slot *s = slot_make(PyThread_get_thread_ident());
    if (s == NULL) {
        return NULL;
    }
    if (pthread_setspecific(slot_key, s) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_setspecific failed");
        return NULL;
    }
    s->adopted = 1;
    __atomic_store_n(&s->owner_gone, 0, __ATOMIC_RELEASE);
    return thread_slot = s;
}

/* The slot of the running thread (`ident`), or NULL: its own, without a search unless values were set by hand for
 * other threads (tests). */
static serving_slot *
slot_of_thread(unsigned long ident)
{
    return thread_slot != NULL ? thread_slot : foreign_slots ? slot_find(ident) : NULL;
}

/* Puts `entry` (its references moved in) into `s`; what was there moves out to `entry`. */
static void
slot_swap(serving_slot *s, served_entry *entry)
{
    served_entry old = s->udf;
    s->udf = *entry;
    *entry = old;
}

static void
entry_release(served_entry *entry)
{
    Py_CLEAR(entry->site);
    Py_CLEAR(entry->call_id);
    Py_CLEAR(entry->trace_id);
}

/* The UDF entry as calls.Served: (site, call id, start ns, trace id). */
static PyObject *
slot_tuple(serving_slot *s)
{
    return Py_BuildValue("(OOLO)", s->udf.site, s->udf.call_id, s->udf.start_ns, s->udf.trace_id);
}

/* A view of one of the two tables. */
typedef struct {
    PyObject_HEAD
    int spans;  /* 0: the UDFs (calls.serving), 1: the SERVER spans (Tracer.serving) */
} ServingTable;

static PyTypeObject ServingTableType;

static int
has_value(ServingTable *t, serving_slot *s)
{
    return t->spans ? s->span != NULL : s->udf.site != NULL;
}

/* The slot's value in this table (a new reference). */
static PyObject *
value_of(ServingTable *t, serving_slot *s)
{
    return t->spans ? Py_NewRef(s->span) : slot_tuple(s);
}

/* Sets (`value` NULL: removes) the slot's value in this table; what was there is released last. */
static int
set_value(ServingTable *t, serving_slot *s, PyObject *value)
{
    if (t->spans) {
        Py_XSETREF(s->span, Py_XNewRef(value));
        return 0;
    }
    served_entry entry = {NULL, NULL, NULL, 0};
    if (value != NULL) {
        long long start_ns = PyTuple_Check(value) && PyTuple_GET_SIZE(value) == 4
            ? PyLong_AsLongLong(PyTuple_GET_ITEM(value, 2)) : -1;
        if (start_ns == -1 && (PyErr_Occurred() || !PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 4)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "an entry is (site, call id, start ns: int, trace id)");
            return -1;
        }
        entry = (served_entry){Py_NewRef(PyTuple_GET_ITEM(value, 0)), Py_NewRef(PyTuple_GET_ITEM(value, 1)),
                               Py_NewRef(PyTuple_GET_ITEM(value, 3)), start_ns};
    }
    slot_swap(s, &entry);
    entry_release(&entry);
    return 0;
}

/* `key` as a thread id; -1 if it is not one (an int from 0): KeyError when looked up (never a key), TypeError when
 * set (`setting`). */
static int
thread_of(PyObject *key, unsigned long *thread, int setting)
{
    *thread = PyLong_Check(key) ? PyLong_AsUnsignedLong(key) : (unsigned long)-1;
    if (*thread == (unsigned long)-1 && (!PyLong_Check(key) || PyErr_Occurred())) {
        PyErr_Clear();
        if (setting) {
            PyErr_SetString(PyExc_TypeError, "a key is a thread id (an int from 0)");
        }
        else {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return -1;
    }
    return 0;
}

/* The slot holding `key`'s value in this table; NULL with KeyError. */
static serving_slot *
slot_of_key(ServingTable *t, PyObject *key)
{
    unsigned long thread;
    if (thread_of(key, &thread, 0) < 0) {
        return NULL;
    }
    serving_slot *s = slot_find(thread);
    if (s == NULL || !has_value(t, s)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return s;
}

/* The entries as a list: pairs (thread, value) or values alone. */
static PyObject *
serving_list(ServingTable *t, int pairs)
{
    PyObject *list = PyList_New(0);
    for (serving_slot *s = serving_slots; list != NULL && s != NULL; s = s->next) {
        if (!has_value(t, s)) {
            continue;
        }
        PyObject *value = value_of(t, s);
        PyObject *item = value != NULL && pairs ? Py_BuildValue("(kN)", s->thread, value) : value;
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_CLEAR(list);
        }
        Py_XDECREF(item);
    }
    return list;
}

static PyObject *
serving_items(ServingTable *t, PyObject *unused)
{
    return serving_list(t, 1);
}

static PyObject *
serving_values(ServingTable *t, PyObject *unused)
{
    return serving_list(t, 0);
}

/* get(thread, default=None) and pop(thread[, default]): the value, removed by pop; a missing one, the default (pop
 * without one: KeyError). */
static PyObject *
serving_lookup(ServingTable *t, PyObject *const *args, Py_ssize_t nargs, int pop)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, pop ? "pop(thread[, default])" : "get(thread, default=None)");
        return NULL;
    }
    serving_slot *s = slot_of_key(t, args[0]);
    if (s == NULL) {
        if (pop && nargs == 1) {
            return NULL;
        }
        PyErr_Clear();
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    }
    PyObject *value = value_of(t, s);
    if (pop && value != NULL) {
        set_value(t, s, NULL);
    }
    return value;
}

static PyObject *
serving_get(ServingTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    return serving_lookup(t, args, nargs, 0);
}

static PyObject *
serving_pop(ServingTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    return serving_lookup(t, args, nargs, 1);
}

static int
serving_set(ServingTable *t, PyObject *key, PyObject *value)
{
    unsigned long thread;
    if (value == NULL) {  /* del table[thread] */
        serving_slot *s = slot_of_key(t, key);
        return s != NULL ? set_value(t, s, NULL) : -1;
    }
    if (thread_of(key, &thread, 1) < 0) {
        return -1;
    }
    serving_slot *s = thread == PyThread_get_thread_ident() ? own_slot() : slot_make(thread);
    foreign_slots |= s != NULL && s != thread_slot;
    return s != NULL ? set_value(t, s, value) : -1;
}

static PyObject *
serving_subscript(ServingTable *t, PyObject *key)
{
    serving_slot *s = slot_of_key(t, key);
    return s != NULL ? value_of(t, s) : NULL;
}

static PyObject *
serving_clear(ServingTable *t, PyObject *unused)
{
    for (serving_slot *s = serving_slots; s != NULL; s = s->next) {
        if (has_value(t, s)) {
            set_value(t, s, NULL);  /* may run Python code: the list stays walkable (slots are never freed) */
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
serving_update(ServingTable *t, PyObject *entries)
{
    if (!PyDict_Check(entries)) {
        PyErr_SetString(PyExc_TypeError, "update(entries: dict)");
        return NULL;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(entries, &pos, &key, &value)) {
        if (serving_set(t, key, value) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static Py_ssize_t
serving_len(ServingTable *t)
{
    Py_ssize_t n = 0;
    for (serving_slot *s = serving_slots; s != NULL; s = s->next) {
        n += has_value(t, s);
    }
    return n;
}

static int
serving_contains(ServingTable *t, PyObject *key)
{
    serving_slot *s = slot_of_key(t, key);
    PyErr_Clear();
    return s != NULL;
}

PyDoc_STRVAR(serving_slots_doc,
"serving_slots()\n--\n\n"
"How many slots the serving tables have made (at most the threads alive at once that served, plus entries set by "
"hand): for tests.");

static PyObject *
serving_slots_count(PyObject *module, PyObject *unused)
{
    Py_ssize_t n = 0;
    for (serving_slot *s = serving_slots; s != NULL; s = s->next) {
        n++;
    }
    return PyLong_FromSsize_t(n);
}

static PyMethodDef serving_methods[] = {
    {"get", (PyCFunction)(void (*)(void))serving_get, METH_FASTCALL, "get(thread, default=None): its value"},
    {"pop", (PyCFunction)(void (*)(void))serving_pop, METH_FASTCALL, "pop(thread[, default]): its value, removed"},
    {"items", (PyCFunction)serving_items, METH_NOARGS, "items(): a list of (thread, value)"},
    {"values", (PyCFunction)serving_values, METH_NOARGS, "values(): a list of the values"},
    {"clear", (PyCFunction)serving_clear, METH_NOARGS, "clear(): no values"},
    {"update", (PyCFunction)serving_update, METH_O, "update(entries: dict): each set"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods serving_as_mapping = {
    .mp_length = (lenfunc)serving_len, .mp_subscript = (binaryfunc)serving_subscript,
    .mp_ass_subscript = (objobjargproc)serving_set,
};
static PySequenceMethods serving_as_sequence = {.sq_contains = (objobjproc)serving_contains};

static PyTypeObject ServingTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rpc_observe.hooks._core.ServingTable",
    .tp_doc = "What each thread serves, by thread id: `_core.serving`, the UDF it runs as (site, call id, start ns, "
              "trace id) (calls.serving's dict is its reference), and `_core.serving_spans`, the SERVER span it "
              "serves (Tracer.serving's dict is its reference); kept per thread in C.",
    .tp_basicsize = sizeof(ServingTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = serving_methods,
    .tp_as_mapping = &serving_as_mapping,
    .tp_as_sequence = &serving_as_sequence,
};

static ServingTable serving_table = {PyObject_HEAD_INIT(&ServingTableType) 0};
static ServingTable serving_spans = {PyObject_HEAD_INIT(&ServingTableType) 1};

static PyObject *s_append, *s_record, *s_response_cells, *s_received, *s_cells, *s_profiler, *s_armed,
    *s_callee_ns, *s_tracer, *s_end, *s_metrics, *s_request_cells_attr,
    *s_fields, *s_start, *s_nbytes, *s_untyped_storage, *s_numel, *s_element_size, *s_context_text,
    *s_echoed, *s_trailer_head, *s_request_cells, *s_sent_bytes;

static int
intern_names(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_append, "append"}, {&s_record, "record"}, {&s_response_cells, "response_cells"}, {&s_received, "received"},
        {&s_cells, "cells"}, {&s_profiler, "profiler"}, {&s_armed, "armed"},
        {&s_callee_ns, "callee_ns"}, {&s_tracer, "tracer"}, {&s_end, "end"}, {&s_metrics, "metrics"}, {&s_request_cells_attr, "request_cells"},
        {&s_fields, "rpc_observe_fields"}, {&s_start, "rpc_observe_start"}, {&s_nbytes, "nbytes"},
        {&s_untyped_storage, "untyped_storage"}, {&s_numel, "numel"}, {&s_element_size, "element_size"},
        {&s_context_text, "context_text"}, {&s_echoed, "echoed"}, {&s_trailer_head, "trailer_head"},
        {&s_request_cells, "request_cells"}, {&s_sent_bytes, "sent_bytes"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* The configured clocks are the time module's own (not a test's): read here, as CPython reads them on Linux
 * (clock_gettime, the same clock and the same conversion), without a call and an int or float object each. */
static int native_time_ns, native_perf_counter;

/* 1 if `clock` is time.<name>, 0 if not, -1 with an error set. */
static int
is_time_function(PyObject *clock, const char *name)
{
    PyObject *time_module = PyImport_ImportModule("time");
    PyObject *function = time_module != NULL ? PyObject_GetAttrString(time_module, name) : NULL;
    Py_XDECREF(time_module);
    if (function == NULL) {
        return -1;
    }
#ifdef __linux__
    int same = function == clock;
#else
    int same = 0;  /* perf_counter is another clock elsewhere (macOS: mach_absolute_time): called */
#endif
    Py_DECREF(function);
    return same;
}

/* CLOCK_REALTIME (time.time_ns) or CLOCK_MONOTONIC (time.perf_counter on Linux) in ns; -1 if it fails. */
static long long
clock_ns(clockid_t id)
{
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0) {
        return -1;
    }
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

PyDoc_STRVAR(configure_doc,
"configure(in_flight, finished, fold_message, fold_split, fold_finished, remote_exception, python_udf,\n"
"          request_cells, finish_call, not_handled, time_ns, next_id, max_in_flight, /)\n--\n\n"
"Hands the hot paths their tables and functions (pickler.py calls it once, at import).");

static PyObject *
configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject **slots[] = {&refs.in_flight, &refs.finished, &refs.fold_message, &refs.fold_split,
                          &refs.fold_finished, &refs.remote_exception, &refs.python_udf,
                          &refs.request_cells, &refs.finish_call, &refs.not_handled, &refs.time_ns,
                          &refs.next_id};
    Py_ssize_t count = (Py_ssize_t)(sizeof(slots) / sizeof(slots[0]));
    if (nargs != count + 1) {
        PyErr_SetString(PyExc_TypeError, "configure takes 13 arguments");
        return NULL;
    }
    if (!PyDict_Check(args[0]) || !PyType_Check(args[5]) || !PyType_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "configure: in_flight must be a dict, the classes types");
        return NULL;
    }
    Py_ssize_t max_in_flight = PyLong_AsSsize_t(args[count]);
    if (max_in_flight == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int native = is_time_function(args[10], "time_ns");
    if (native < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    refs.max_in_flight = max_in_flight;
    native_time_ns = native;
    Py_CLEAR(id_counter);
    PyObject *counter = PyObject_GetAttrString(refs.next_id, "__self__");
    if (counter == NULL) {
        PyErr_Clear();  /* not a bound method: called as it is */
    }
    else if (strcmp(Py_TYPE(counter)->tp_name, "itertools.count") == 0 && Py_TYPE(counter)->tp_iternext != NULL) {
        PyObject *name = PyObject_GetAttrString(refs.next_id, "__name__");
        int is_next = name != NULL && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__next__") == 0;
        Py_XDECREF(name);
        PyErr_Clear();
        id_counter = is_next ? Py_NewRef(counter) : NULL;
    }
    Py_XDECREF(counter);
    Py_RETURN_NONE;
}

/* The next call id: next_id(), read straight from its itertools.count where it is one's __next__ (a method
 * wrapper's call goes through a tuple of arguments). */
static PyObject *
new_call_id(void)
{
    return id_counter != NULL ? Py_TYPE(id_counter)->tp_iternext(id_counter) : PyObject_CallNoArgs(refs.next_id);
}

/* tensor_sizes(tensors) of pickler.py: (logical bytes, storage bytes that travel) of a tensor table. */
#define MIN_RECOPY_BYTES (8 * 1024)
#define MIN_MULTIPLE 2

static long long
long_attr_or_call(PyObject *obj, PyObject *name, int call)
{
    PyObject *value = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    long long n = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return n;
}

/* a + b and a * b, held at LLONG_MAX instead of overflowing (a sparse tensor's numel can be anything). */
static long long
held_add(long long a, long long b)
{
    long long out;
    return __builtin_add_overflow(a, b, &out) ? LLONG_MAX : out;
}

static long long
held_mul(long long a, long long b)
{
    long long out;
    return __builtin_mul_overflow(a, b, &out) ? LLONG_MAX : out;
}

static int
tensor_sizes(PyObject *tensors, long long *logical, long long *traveling)
{
    *logical = *traveling = 0;
    PyObject *seq = PySequence_Fast(tensors, "the tensor table is not a sequence");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        long long useful = long_attr_or_call(t, s_nbytes, 0), storage = -1;
        if (!(useful == -1 && PyErr_Occurred())) {
            PyObject *st = PyObject_CallMethodNoArgs(t, s_untyped_storage);
            if (st != NULL) {
                storage = long_attr_or_call(st, s_nbytes, 1);
                Py_DECREF(st);
            }
        }
        if (PyErr_Occurred()) {  /* sparse and other storage-less tensors (any Exception, as the reference) */
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                Py_DECREF(seq);
                return -1;
            }
            PyErr_Clear();
            long long numel = long_attr_or_call(t, s_numel, 1);
            long long size = numel == -1 && PyErr_Occurred() ? -1 : long_attr_or_call(t, s_element_size, 1);
            if (PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            useful = storage = held_mul(numel, size);
        }
        *logical = held_add(*logical, useful);
        int recopied = storage >= MIN_RECOPY_BYTES && storage >= held_mul(useful, MIN_MULTIPLE);
        *traveling = held_add(*traveling, recopied ? useful : storage);
    }
    Py_DECREF(seq);
    return 0;
}

/* A metric record, pushed as it is (no tuple, no number objects) where `record` is a `Records` queue's append,
 * else made as the tuple metrics.py declares and handed to `record` (the reference; with the fold below). */
enum { FOLD_MESSAGE, FOLD_STARTED, FOLD_FINISHED, FOLD_SPLIT, FOLD_SERVED, FOLDS };
enum { N_PAYLOAD, N_TENSORS, N_LOGICAL, N_TRAVELING, N_WIRE, NUMBERS };
typedef struct {
    int fold;  /* FOLD_*, or -1: `cells` is a record appended as a Python object */
    PyObject *cells;  /* strong */
    PyObject *other;  /* strong: FOLD_MESSAGE the peer bytes cell, else the span; None if none */
    long long n[NUMBERS];  /* FOLD_MESSAGE's counts */
    double s[2];  /* seconds; FOLD_SPLIT: and the callee's seconds */
} crecord;
static int push_record(PyObject *record, crecord *r);

/* `record((fold_message, cells, payload bytes, tensors, tensor bytes, storage bytes, seconds, peer cell, wire))` */
static int
record_message(PyObject *record, PyObject *cells, Py_ssize_t payload, PyObject *tensors, double seconds,
               PyObject *peer_cell, Py_ssize_t message_bytes)
{
    long long logical = 0, traveling = 0;
    Py_ssize_t count = PyObject_Length(tensors);
    if (count < 0 || (count > 0 && tensor_sizes(tensors, &logical, &traveling) < 0)) {
        return -1;
    }
    crecord r = {FOLD_MESSAGE, cells, peer_cell != NULL ? peer_cell : Py_None,
                 {payload, count, logical, traveling, peer_cell != NULL ? held_add((long long)message_bytes, traveling)
                                                                        : 0LL}, {seconds, 0.0}};
    return push_record(record, &r);
}

/* time.time_ns(), through the configured clock; -1 with an error set if it fails. */
static long long
now_ns(void)
{
    if (native_time_ns) {
        long long ns = clock_ns(CLOCK_REALTIME);
        if (ns < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return ns;
    }
    PyObject *now = PyObject_CallNoArgs(refs.time_ns);
    if (now == NULL) {
        return -1;
    }
    long long ns = PyLong_AsLongLong(now);
    Py_DECREF(now);
    return ns;
}

/* ---- CallBase: the fields of calls.Call in a C struct (calls.Call subclasses it where the core is built) ----
 * The hot paths read and write them directly: a call made in C creates no int object for its start, thread or
 * id, and no attribute is looked up through the type. Python sees the same names (members); an object field
 * never set reads None, as the Python class's fields are all set in __init__. */
typedef struct {
    PyObject_HEAD
    PyObject *runtime, *site, *span, *rf, *future, *parent;
    long long start_ns, id, tid;
    unsigned long thread;
} CallObject;

static PyTypeObject CallBaseType;
#define AS_CALL(obj) (PyObject_TypeCheck((obj), &CallBaseType) ? (CallObject *)(obj) : NULL)
/* An object field: a new reference, None if never set. */
#define CALL_FIELD(call, name) Py_NewRef((call)->name != NULL ? (call)->name : Py_None)

static int
call_traverse(CallObject *self, visitproc visit, void *arg)
{
    /* not the type: subtype_traverse visits a heap subclass (calls.Call) whose base is static */
    Py_VISIT(self->runtime);
    Py_VISIT(self->site);
    Py_VISIT(self->span);
    Py_VISIT(self->rf);
    Py_VISIT(self->future);
    Py_VISIT(self->parent);
    return 0;
}

static int
call_clear(CallObject *self)
{
    Py_CLEAR(self->runtime);
    Py_CLEAR(self->site);
    Py_CLEAR(self->span);
    Py_CLEAR(self->rf);
    Py_CLEAR(self->future);
    Py_CLEAR(self->parent);
    return 0;
}

static void
call_dealloc(CallObject *self)
{
    PyObject_GC_UnTrack(self);
    call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef call_members[] = {
    {"runtime", T_OBJECT, offsetof(CallObject, runtime), 0, "the Runtime that observes the call"},
    {"site", T_OBJECT, offsetof(CallObject, site), 0, "its ClientSite"},
    {"span", T_OBJECT, offsetof(CallObject, span), 0, "its CLIENT SpanRecord, or None"},
    {"rf", T_OBJECT, offsetof(CallObject, rf), 0, "its open profiler event, or None"},
    {"future", T_OBJECT, offsetof(CallObject, future), 0, "the future the sweep or the wait reads, or None"},
    {"parent", T_OBJECT, offsetof(CallObject, parent), 0, "the UDF its thread was serving when it began, or None"},
    {"start_ns", T_LONGLONG, offsetof(CallObject, start_ns), 0, "time.time_ns() at its start"},
    {"id", T_LONGLONG, offsetof(CallObject, id), 0, "its call id (0: none)"},
    {"tid", T_LONGLONG, offsetof(CallObject, tid), 0, "the native id of its thread for profiler events (0: none)"},
    {"thread", T_ULONG, offsetof(CallObject, thread), 0, "threading.get_ident() of the thread that issued it"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CallBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rpc_observe.hooks._core.CallBase",
    .tp_doc = "The fields of calls.Call as a C struct (calls.Call is its subclass where the core is built).",
    .tp_basicsize = sizeof(CallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_traverse = (traverseproc)call_traverse,
    .tp_clear = (inquiry)call_clear,
    .tp_members = call_members,
};

/* ---- FinishedCalls: the flight recorder's last finished calls (calls.FinishedCalls is its reference) ----
 * A ring of `maxlen` entries, oldest first: the echoed ending pushes its call's numbers as they are (no tuple, no
 * int objects), Python appends calls.Finished tuples; a tuple is made only when the recorder reads the ring. One
 * object for the process's life: `resize` takes RPC_OBSERVE_RECORDER_SIZE. Every access holds the GIL, and an entry
 * that leaves the ring is released only after the ring is consistent again (a release may run Python code). */
typedef struct {
    PyObject *site, *error;  /* strong; error: the error.type text or None */
    long long id, start_ns, end_ns;
} finished_entry;

typedef struct {
    PyObject_HEAD
    finished_entry *ring;
    Py_ssize_t maxlen, head, count;  /* the oldest entry at ring[head] */
} FinishedCalls;

static PyTypeObject FinishedCallsType;

static void
entries_release(finished_entry *entries, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(entries[i].site);
        Py_XDECREF(entries[i].error);
    }
}

/* Adds an entry (its references added); the oldest leaves when the ring is full. */
static void
finished_push(FinishedCalls *f, PyObject *site, long long id, long long start_ns, long long end_ns, PyObject *error)
{
    if (f->maxlen == 0) {
        return;
    }
    finished_entry old = {NULL, NULL, 0, 0, 0};
    Py_ssize_t at;
    if (f->count == f->maxlen) {  /* the oldest's slot, and the next oldest is the head */
        at = f->head;
        old = f->ring[at];
        f->head = (at + 1) % f->maxlen;
    }
    else {
        at = (f->head + f->count++) % f->maxlen;
    }
    f->ring[at] = (finished_entry){Py_NewRef(site), Py_NewRef(error), id, start_ns, end_ns};
    entries_release(&old, 1);
}

/* Moves the newest `count` entries into `ring` (room for `maxlen`, taken), then releases the older ones. */
static int
finished_set(FinishedCalls *f, finished_entry *ring, Py_ssize_t maxlen, Py_ssize_t count)
{
    finished_entry *old = f->ring;
    Py_ssize_t old_head = f->head, old_count = f->count, old_maxlen = f->maxlen;
    /* the entries that do not fit, copied out before the ring changes, released after */
    Py_ssize_t dropped = old_count - count;
    finished_entry *gone = dropped > 0 ? PyMem_Malloc((size_t)dropped * sizeof(finished_entry)) : NULL;
    if (dropped > 0 && gone == NULL) {
        PyMem_Free(ring);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_count; i++) {
        finished_entry e = old[(old_head + i) % old_maxlen];
        if (i < dropped) {
            gone[i] = e;
        }
        else {
            ring[i - dropped] = e;
        }
    }
    f->ring = ring, f->maxlen = maxlen, f->head = 0, f->count = count;
    PyMem_Free(old);
    if (gone != NULL) {
        entries_release(gone, dropped);
        PyMem_Free(gone);
    }
    return 0;
}

/* Keeps the newest `keep` entries (at most) in a ring of `maxlen`. */
static int
finished_resize(FinishedCalls *f, Py_ssize_t maxlen, Py_ssize_t keep)
{
    if (maxlen < 0 || maxlen > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(finished_entry)) {
        PyErr_SetString(PyExc_ValueError, "maxlen must be an int from 0");
        return -1;
    }
    finished_entry *ring = PyMem_Malloc((size_t)(maxlen ? maxlen : 1) * sizeof(finished_entry));
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    keep = keep < maxlen ? keep : maxlen;
    return finished_set(f, ring, maxlen, f->count < keep ? f->count : keep);
}

static PyObject *
finished_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t maxlen;
    static char *names[] = {"maxlen", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:FinishedCalls", names, &maxlen)) {
        return NULL;
    }
    FinishedCalls *f = (FinishedCalls *)type->tp_alloc(type, 0);
    if (f == NULL) {
        return NULL;
    }
    if (finished_resize(f, maxlen, 0) < 0) {
        Py_DECREF(f);
        return NULL;
    }
    return (PyObject *)f;
}

PyDoc_STRVAR(finished_append_doc,
"append(finished, /)\n--\n\n"
"Adds a calls.Finished tuple (site, call id, start ns, end ns, error.type or None); the oldest leaves when full.");

static PyObject *
finished_append(FinishedCalls *f, PyObject *item)
{
    long long n[3];
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_SetString(PyExc_TypeError, "a finished call is (site, call id, start ns, end ns, error.type or None)");
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        if ((n[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(item, i + 1))) == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    finished_push(f, PyTuple_GET_ITEM(item, 0), n[0], n[1], n[2], PyTuple_GET_ITEM(item, 4));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(finished_resize_doc,
"resize(maxlen, /)\n--\n\n"
"Keeps the newest `maxlen` calls, and that many from now on.");

static PyObject *
finished_resize_method(FinishedCalls *f, PyObject *arg)
{
    Py_ssize_t maxlen = PyLong_AsSsize_t(arg);
    if ((maxlen == -1 && PyErr_Occurred()) || finished_resize(f, maxlen, maxlen) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(finished_clear_doc, "clear()\n--\n\nForgets every call.");

static PyObject *
finished_clear_method(FinishedCalls *f, PyObject *unused)
{
    return finished_resize(f, f->maxlen, 0) < 0 ? NULL : Py_NewRef(Py_None);
}

/* The calls as a list of calls.Finished tuples, oldest first. */
static PyObject *
finished_list(FinishedCalls *f)
{
    PyObject *list = PyList_New(f->count);
    for (Py_ssize_t i = 0; list != NULL && i < f->count; i++) {
        finished_entry *e = &f->ring[(f->head + i) % f->maxlen];
        PyObject *item = Py_BuildValue("(OLLLO)", e->site, e->id, e->start_ns, e->end_ns, e->error);
        if (item == NULL) {
            Py_CLEAR(list);
        }
        else {
            PyList_SET_ITEM(list, i, item);
        }
    }
    return list;
}

static PyObject *
finished_iter(FinishedCalls *f)
{
    PyObject *list = finished_list(f);
    PyObject *it = list != NULL ? PyObject_GetIter(list) : NULL;
    Py_XDECREF(list);
    return it;
}

static Py_ssize_t
finished_len(FinishedCalls *f)
{
    return f->count;
}

static PyObject *
finished_maxlen(FinishedCalls *f, void *closure)
{
    return PyLong_FromSsize_t(f->maxlen);
}

static int
finished_traverse(FinishedCalls *f, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < f->count; i++) {
        finished_entry *e = &f->ring[(f->head + i) % f->maxlen];
        Py_VISIT(e->site);
        Py_VISIT(e->error);
    }
    return 0;
}

static int
finished_tp_clear(FinishedCalls *f)
{
    finished_entry *ring = PyMem_Malloc(sizeof(finished_entry) * (size_t)(f->maxlen ? f->maxlen : 1));
    if (ring == NULL || finished_set(f, ring, f->maxlen, 0) < 0) {
        PyErr_Clear();  /* no memory: the entries stay (a later clear or the dealloc releases them) */
    }
    return 0;
}

static void
finished_dealloc(FinishedCalls *f)
{
    PyObject_GC_UnTrack(f);
    Py_ssize_t count = f->count;
    f->count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        entries_release(&f->ring[(f->head + i) % f->maxlen], 1);
    }
    PyMem_Free(f->ring);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef finished_methods[] = {
    {"append", (PyCFunction)finished_append, METH_O, finished_append_doc},
    {"resize", (PyCFunction)finished_resize_method, METH_O, finished_resize_doc},
    {"clear", (PyCFunction)finished_clear_method, METH_NOARGS, finished_clear_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef finished_getset[] = {
    {"maxlen", (getter)finished_maxlen, NULL, "how many calls it keeps", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods finished_as_sequence = {.sq_length = (lenfunc)finished_len};

static PyTypeObject FinishedCallsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rpc_observe.hooks._core.FinishedCalls",
    .tp_doc = "FinishedCalls(maxlen): the last finished calls, oldest first (calls.FinishedCalls is its reference).",
    .tp_basicsize = sizeof(FinishedCalls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = finished_new,
    .tp_dealloc = (destructor)finished_dealloc,
    .tp_traverse = (traverseproc)finished_traverse,
    .tp_clear = (inquiry)finished_tp_clear,
    .tp_iter = (getiterfunc)finished_iter,
    .tp_methods = finished_methods,
    .tp_getset = finished_getset,
    .tp_as_sequence = &finished_as_sequence,
};

/* ---- Attributes read where __slots__ put them ----
 * The sites, span records and other objects the hot paths read are instances of classes with __slots__: an
 * attribute of theirs is read at the offset its member descriptor names, found once per (type, name) and kept in a
 * small table with the type's version tag, which CPython changes whenever the type or a base is changed (a
 * descriptor replaced, __getattribute__ set), so the entry is found anew then. Anything else (an instance dict, a
 * property, a type without a valid tag, an unset slot) is PyObject_GetAttr's, as before. */
/* 8-way sets under a multiplicative hash: a process reads ~30 (type, name) pairs, which a direct-mapped table of 64
 * mapped onto each other (9 misses per RPC, each a type lookup, in the benchmark's (d)); nine of them in one set are
 * about a chance in a million. A miss takes way 0 and moves the others down. (Were the set changed by code the type
 * lookup ran, `last` would only drop another entry: `old` is read after it.) */
#define SLOT_SETS 64
#define SLOT_WAYS 8
static Py_ssize_t slot_misses;  /* for tests: the hot paths find their attributes in the table */
static struct slot_entry {
    PyTypeObject *type;  /* strong: no other type can take its address while it is here */
    PyObject *name;  /* strong */
    unsigned int tag;  /* the type's tp_version_tag when found; 0: never valid */
    Py_ssize_t offset;  /* -1: not a plain slot, read by name */
} slot_entries[SLOT_SETS][SLOT_WAYS];

/* The offset of `name`'s slot in instances of `type`, or -1: read it by name. */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    uint64_t key = (uint64_t)(uintptr_t)type * 0x9E3779B97F4A7C15u ^ (uint64_t)(uintptr_t)name * 0xC2B2AE3D27D4EB4Fu;
    struct slot_entry *set = slot_entries[(key >> 40) % SLOT_SETS];
    int last = SLOT_WAYS - 1;  /* the way a miss drops: the last, or this pair's stale entry */
    for (int way = 0; way < SLOT_WAYS; way++) {
        struct slot_entry *e = &set[way];
        if (e->type == type && e->name == name) {
            if (e->tag != 0 && e->tag == type->tp_version_tag) {
                return e->offset;
            }
            last = way;  /* stale: found anew below, in way 0 */
            break;
        }
    }
    slot_misses++;
    PyObject *descr = type->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(type, name) : NULL;  /* borrowed */
    Py_ssize_t offset = -1;
    if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
        PyType_IsSubtype(type, PyDescr_TYPE(descr))) {  /* not another class's descriptor set on this one */
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        offset = member->type == T_OBJECT_EX && !(member->flags & PY_AUDIT_READ) ? member->offset : -1;
    }
    struct slot_entry old = set[last];
    memmove(&set[1], &set[0], (size_t)last * sizeof(struct slot_entry));
    set[0].type = (PyTypeObject *)Py_NewRef((PyObject *)type), set[0].name = Py_NewRef(name);
    set[0].tag = type->tp_version_tag, set[0].offset = offset;  /* the tag _PyType_Lookup gave it (0 if none could be) */
    Py_XDECREF(old.type);  /* last: a release may run code that takes this set again */
    Py_XDECREF(old.name);
    return offset;
}

/* An attribute that must be there; NULL (with the AttributeError) if not. */
static PyObject *
get_attr(PyObject *obj, PyObject *name)
{
    Py_ssize_t offset = slot_offset(Py_TYPE(obj), name);
    PyObject *value = offset >= 0 ? *(PyObject **)((char *)obj + offset) : NULL;
    return value != NULL ? Py_NewRef(value) : PyObject_GetAttr(obj, name);
}
#define GET(obj, name) get_attr((obj), (name))

PyDoc_STRVAR(slot_attr_doc,
"slot_attr(obj, name, /)\n--\n\n"
"getattr(obj, name) as the C paths read it (at the offset of a __slots__ member where it is one): for tests.");

static PyObject *
slot_attr(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "slot_attr(obj, name: str)");
        return NULL;
    }
    PyObject *name = Py_NewRef(args[1]);
    PyUnicode_InternInPlace(&name);  /* the C paths' names are interned: one entry per name */
    PyObject *value = get_attr(args[0], name);
    Py_DECREF(name);
    return value;
}

PyDoc_STRVAR(slot_misses_doc,
"slot_misses()\n--\n\n"
"How many times the C paths looked an attribute up rather than finding it in their table: for tests.");

static PyObject *
slot_misses_count(PyObject *module, PyObject *unused)
{
    return PyLong_FromSsize_t(slot_misses);
}

static PyObject *client_context_text(PyObject *tracer, PyObject *span);  /* with the spans, below */
static int end_span(PyObject *tracer, PyObject *span, long long end_ns);
enum { SPAN_END_NS = 9, SPAN_CALLEE_NS = 12 };  /* span_slots */
static int span_set(PyObject *span, int i, PyObject *name, PyObject *value);

/* The echoed response of a call in flight: ends the call (pickler.py's Python fast path, line by line). */
static PyObject *
end_echoed(PyObject *runtime, PyObject *obj, Py_ssize_t message_size, PyObject *tensors, double seconds,
           trailer_view *t)
{
    PyObject *call = PyDict_GetItemWithError(refs.in_flight, t->call_id);
    CallObject *fields = call != NULL ? AS_CALL(call) : NULL;
    if (fields == NULL) {  /* not in flight (any more), or not a Call: the general path */
        return PyErr_Occurred() ? NULL : Py_NewRef(refs.not_handled);
    }
    Py_INCREF(call);
    if (PyDict_DelItem(refs.in_flight, t->call_id) < 0) {
        Py_DECREF(call);
        return NULL;
    }
    PyObject *site = NULL, *record = NULL, *cells = NULL, *received = NULL, *rf = NULL, *profiler = NULL;
    PyObject *armed = NULL, *span = NULL, *rec = NULL, *result = NULL, *done = NULL;
    long long end_ns = now_ns();
    if (end_ns == -1 && PyErr_Occurred()) {
        Py_DECREF(call);
        return NULL;
    }
    long long callee_ns = t->callee_us >= 0 ? t->callee_us * 1000 : -1;
    site = CALL_FIELD(fields, site);
    if ((record = GET(site, s_record)) == NULL) {
        goto done;
    }
    if (record != Py_None) {  /* what came from the peer: pickle, trailer and storages */
        if ((cells = GET(site, s_response_cells)) == NULL || (received = GET(site, s_received)) == NULL ||
            record_message(record, cells, t->pickle_size, tensors, seconds, received, message_size) < 0) {
            goto done;
        }
        Py_CLEAR(cells);
    }
    rf = CALL_FIELD(fields, rf);
    if ((profiler = GET(runtime, s_profiler)) == NULL) {
        goto done;
    }
    int profiled = 0;
    if (profiler != Py_None) {
        if ((armed = GET(profiler, s_armed)) == NULL || (profiled = PyObject_IsTrue(armed)) < 0) {
            goto done;
        }
    }
    if (Py_IS_TYPE(obj, (PyTypeObject *)refs.remote_exception) || (rf == Py_None && profiled)) {
        done = PyObject_CallFunction(refs.finish_call, "OOLL", call, obj, end_ns, callee_ns);
        if (done != NULL) {
            result = Py_NewRef(obj);
        }
        goto done;
    }
    /* Call.finish, inline, for a successful call whose profiler event, if any, is torch's own (its future ends
     * it; Call.finish keeps an event only for a call without one, once a profiler is armed) (test_endings.py). */
    long long start_ns = fields->start_ns;
    span = CALL_FIELD(fields, span);
    if (Py_IS_TYPE(refs.finished, &FinishedCallsType)) {
        finished_push((FinishedCalls *)refs.finished, site, fields->id, start_ns, end_ns, Py_None);
    }
    else if ((rec = Py_BuildValue("(OOLLO)", site, t->call_id, start_ns, end_ns, Py_None)) == NULL ||
             (done = PyObject_CallMethodOneArg(refs.finished, s_append, rec)) == NULL) {
        goto done;
    }
    Py_CLEAR(rec);
    Py_CLEAR(done);
    if (record != Py_None) {
        if ((cells = GET(site, s_cells)) == NULL) {
            goto done;
        }
        crecord r = {callee_ns >= 0 ? FOLD_SPLIT : FOLD_FINISHED, cells, span, {0},
                     {(double)(end_ns - start_ns) / 1e9, (double)callee_ns / 1e9}};
        if (push_record(record, &r) < 0) {
            goto done;
        }
    }
    if (span != Py_None) {
        PyObject *tracer = NULL, *callee = PyLong_FromLongLong(callee_ns);
        int failed = callee == NULL || span_set(span, SPAN_CALLEE_NS, s_callee_ns, callee) < 0 ||
                     (tracer = GET(runtime, s_tracer)) == NULL || end_span(tracer, span, end_ns) < 0;
        Py_XDECREF(callee);
        Py_XDECREF(tracer);
        if (failed) {
            goto done;
        }
    }
    result = Py_NewRef(obj);
done:
    Py_DECREF(call);
    Py_XDECREF(site);
    Py_XDECREF(record);
    Py_XDECREF(cells);
    Py_XDECREF(received);
    Py_XDECREF(rf);
    Py_XDECREF(profiler);
    Py_XDECREF(armed);
    Py_XDECREF(span);
    Py_XDECREF(rec);
    Py_XDECREF(done);
    return result;
}

/* The request this thread unpickled last, for the `_run_function` that follows it: torch runs a request's UDF
 * right after unpickling it, on the same thread, in the same callback (server.py keys its per-thread tables the
 * same way). Where Python makes an `_IncomingUDF` that carries the caller's fields and the unpickling's start (an
 * object and its dict per request), the C path keeps them here, with the UDF object torch got, which `run_start`
 * compares by identity: held (a strong reference) until then, so that the address cannot be another object's. A
 * request whose UDF torch never runs (a failure between the two) is held until the next one on this thread. */
static __thread struct {
    PyObject *udf, *fields;
    double start;
} incoming;

PyDoc_STRVAR(take_incoming_doc,
"take_incoming()\n--\n\n"
"The request this thread unpickled last and has not run yet, taken: (the UDF torch got, the caller's fields, the\n"
"unpickling's start), or None (for tests: _run_function takes it where it runs).");

static PyObject *
take_incoming(PyObject *module, PyObject *unused)
{
    if (incoming.udf == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *kept = Py_BuildValue("(NNd)", incoming.udf, incoming.fields, incoming.start);  /* steals both */
    incoming.udf = incoming.fields = NULL;
    return kept;
}

/* A request with a valid trailer: its fields kept for _run_function, its message record (pickler.py, line by line;
 * the UDF torch gets is its own). */
static PyObject *
take_request(PyObject *runtime, PyObject *obj, PyObject *tensors, double start, double seconds, trailer_view *t)
{
    PyObject *metrics = NULL, *table = NULL, *cells = NULL, *record = NULL, *result = NULL;
    PyObject *held_udf = incoming.udf, *held_fields = incoming.fields;  /* released once the new ones are in */
    incoming.udf = Py_NewRef(obj), incoming.fields = Py_NewRef(t->fields), incoming.start = start;
    Py_XDECREF(held_udf);
    Py_XDECREF(held_fields);
    if ((metrics = GET(runtime, s_metrics)) == NULL) {
        goto done;
    }
    if (metrics != Py_None) {
        if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) < 2) {
            PyErr_SetString(PyExc_TypeError, "a PythonUDF without func and args");
            goto done;
        }
        PyObject *func = PyTuple_GET_ITEM(obj, 0);
        if ((table = GET(runtime, s_request_cells_attr)) == NULL) {
            goto done;
        }
        cells = PyDict_Check(table) ? PyDict_GetItemWithError(table, func) : NULL;  /* borrowed */
        if (cells == NULL) {
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {  /* an unhashable func: _request_cells copes */
                    goto done;
                }
                PyErr_Clear();
            }
            cells = PyObject_CallFunctionObjArgs(refs.request_cells, runtime, func, PyTuple_GET_ITEM(obj, 1), NULL);
            if (cells == NULL) {
                goto done;
            }
        }
        else {
            Py_INCREF(cells);
        }
        if ((record = GET(metrics, s_record)) == NULL ||
            record_message(record, cells, t->pickle_size, tensors, seconds, NULL, 0) < 0) {
            goto done;
        }
    }
    result = Py_NewRef(obj);
done:
    Py_XDECREF(metrics);
    Py_XDECREF(table);
    Py_XDECREF(cells);
    Py_XDECREF(record);
    return result;
}

/* pickler.deserialize's fast paths after torch unpickled `obj` from `data` (`start`: perf_counter() before,
 * `seconds` it took): ends the call an echoed response names, or gives the UDF of a request with the caller's
 * fields; returns what torch gets, or `not_handled` (configure) for the general path. */
static PyObject *
handle(PyObject *runtime, PyObject *obj, PyObject *data, PyObject *tensors, double start, double seconds)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    trailer_view t;
    enum kind kind = read_trailer(view.buf, view.len, &t);
    Py_ssize_t message_size = view.len;
    PyBuffer_Release(&view);
    PyObject *result;
    if (kind == RESPONSE) {
        result = end_echoed(runtime, obj, message_size, tensors, seconds, &t);
        Py_DECREF(t.call_id);
    }
    else if (kind == REQUEST) {
        result = Py_IS_TYPE(obj, (PyTypeObject *)refs.python_udf)
            ? take_request(runtime, obj, tensors, start, seconds, &t) : Py_NewRef(refs.not_handled);
        Py_DECREF(t.fields);
    }
    else {
        result = kind == FAILED ? NULL : Py_NewRef(refs.not_handled);
    }
    return result;
}


/* A request this thread's client call pickled: its trailer, its message record, the call in the table. */
static PyObject *
send_request(PyObject *runtime, PyObject *call, PyObject *data, PyObject *tensors, double seconds)
{
    PyObject *site = NULL, *span = NULL, *context = NULL, *echoed = NULL, *call_id = NULL, *head = NULL;
    PyObject *message = NULL, *record = NULL, *cells = NULL, *client_cells = NULL, *sent = NULL, *result = NULL;
    CallObject *fields = AS_CALL(call);
    if (fields == NULL) {
        return Py_NewRef(refs.not_handled);  /* not a Call: the general path */
    }
    site = CALL_FIELD(fields, site);
    span = CALL_FIELD(fields, span);
    if (span != Py_None) {
        PyObject *tracer = GET(runtime, s_tracer);
        context = tracer != NULL ? client_context_text(tracer, span) : NULL;
        Py_XDECREF(tracer);
    }
    else {
        context = PyUnicode_FromStringAndSize(NULL, 0);
    }
    if (context == NULL || (echoed = GET(site, s_echoed)) == NULL) {
        goto done;
    }
    int echo = PyObject_IsTrue(echoed);
    if (echo < 0) {
        goto done;
    }
    call_id = echo && PyDict_GET_SIZE(refs.in_flight) < refs.max_in_flight ? new_call_id() : PyLong_FromLong(0);
    Py_ssize_t payload = 0;
    if (call_id == NULL || (head = GET(site, s_trailer_head)) == NULL ||
        (message = pack_request(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), head, call_id, context,
                                &payload)) == NULL ||
        (record = GET(site, s_record)) == NULL) {
        goto done;
    }
    if (record != Py_None) {
        if ((cells = GET(site, s_request_cells)) == NULL || (client_cells = GET(site, s_cells)) == NULL ||
            (sent = GET(client_cells, s_sent_bytes)) == NULL ||
            record_message(record, cells, PyBytes_GET_SIZE(data), tensors, seconds, sent,
                           PyBytes_GET_SIZE(message)) < 0) {
            goto done;
        }
    }
    long long id = PyLong_AsLongLong(call_id);
    if ((id == -1 && PyErr_Occurred()) || (id != 0 && PyDict_SetItem(refs.in_flight, call_id, call) < 0)) {
        goto done;  /* in the table only once nothing of ours can fail before the request leaves */
    }
    fields->id = id;
    result = PyTuple_Pack(2, message, tensors);
done:
    Py_XDECREF(site);
    Py_XDECREF(span);
    Py_XDECREF(context);
    Py_XDECREF(echoed);
    Py_XDECREF(call_id);
    Py_XDECREF(head);
    Py_XDECREF(message);
    Py_XDECREF(record);
    Py_XDECREF(cells);
    Py_XDECREF(client_cells);
    Py_XDECREF(sent);
    return result;
}

/* The response of the UDF this thread ran: the echo and the callee's time, and its message record. */
static PyObject *
send_response(PyObject *site, PyObject *echo, double request_start, PyObject *data, PyObject *tensors, double start,
              double seconds)
{
    PyObject *message = NULL, *callee = NULL, *record = NULL, *cells = NULL, *result = NULL;
    int echoed = PyObject_IsTrue(echo);
    if (echoed < 0) {
        return NULL;
    }
    if (echoed) {  /* the callee's time: from unpickling the request to having pickled this response */
        callee = request_start != 0.0 ? PyLong_FromDouble((start + seconds - request_start) * 1e6) : PyLong_FromLong(-1);
        if (callee == NULL ||
            (message = pack_response(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), echo, callee)) == NULL) {
            goto done;
        }
    }
    else {
        message = Py_NewRef(data);
    }
    if ((record = GET(site, s_record)) == NULL) {
        goto done;
    }
    if (record != Py_None) {
        if ((cells = GET(site, s_response_cells)) == NULL ||
            record_message(record, cells, PyBytes_GET_SIZE(data), tensors, seconds, NULL, 0) < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(2, message, tensors);
done:
    Py_XDECREF(message);
    Py_XDECREF(callee);
    Py_XDECREF(record);
    Py_XDECREF(cells);
    return result;
}

/* pickler.serialize's fast paths after torch pickled `obj` into `data` (`start`, `seconds`: as `handle`'s): a
 * client call's request, or the response of the UDF this thread ran; returns what torch gets, or `not_handled`
 * (configure) for the general path, before anything was taken or changed. */
static PyObject *
serialized(PyObject *runtime, PyObject *obj, PyObject *data, PyObject *tensors, double start, double seconds)
{
    if (!PyBytes_CheckExact(data)) {
        return Py_NewRef(refs.not_handled);
    }
    if (Py_IS_TYPE(obj, (PyTypeObject *)refs.python_udf)) {
        PyObject *call = thread_call;
        if (call != NULL) {
            Py_INCREF(call);  /* held: the Python code send_request may run could set another */
            PyObject *result = send_request(runtime, call, data, tensors, seconds);
            Py_DECREF(call);
            return result;
        }
    }
    PyObject *site, *echo;
    double request_start;
    if (!take_reply(&site, &echo, &request_start)) {
        return Py_NewRef(refs.not_handled);  /* an RRef fetch's reply, or not ours */
    }
    PyObject *result = send_response(site, echo, request_start, data, tensors, start, seconds);
    Py_DECREF(site);
    Py_DECREF(echo);
    return result;
}

/* ---- The pickler's two methods as C objects: no Python frame of ours per message ---- */

/* What `configure_hooks` hands over once (strong references). */
static struct {
    PyObject *runtime_module;  /* telemetry.runtime: `.current`, the Runtime or None */
    PyObject *perf_counter;  /* time.perf_counter (a test's clock in tests) */
    PyObject *internal_error;  /* health.internal_error(where) */
    PyObject *on_other_message;  /* pickler._on_other_message: deserialize's general path */
    PyObject *serialize_other;  /* pickler._serialize_other: serialize's general path */
    PyObject *where_serialize, *where_deserialize;  /* "serialize", "deserialize" */
    PyObject *where_start, *where_detach, *where_end;  /* "server_start", "server_detach", "server_end" */
    /* _run_function's: server.py's helpers and tables */
    PyObject *serving;  /* calls.serving */
    PyObject *proxies;  /* naming.PROXY_FUNCTIONS */
    PyObject *site_of;  /* server._site_of(runtime, python_udf, fields): the general lookup */
    PyObject *end_other;  /* server._end_other(runtime, site, start_ns, span, tid, result, fields, request_start) */
    PyObject *fold_served;
    PyObject *native_id;  /* threading.get_native_id */
    PyObject *unknown;  /* "unknown" */
} hook_refs;

static PyObject *s_current;

/* Raises `exc` again (PyErr_SetRaisedException of 3.12, for 3.11); steals the reference. */
static void
PyErr_SetRaisedException_compat(PyObject *exc)
{
    PyObject *type = Py_NewRef((PyObject *)Py_TYPE(exc));
    PyObject *traceback = PyException_GetTraceback(exc);
    PyErr_Restore(type, exc, traceback);
}

/* The exception being raised, taken (PyErr_GetRaisedException of 3.12, for 3.11). */
static PyObject *
raised(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != NULL && traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

/* Counts the exception being raised in our code (health.internal_error, with it as the one being handled, as
 * in an except block) and clears it; an exception that is not an Exception (KeyboardInterrupt) stays raised. */
static int
swallow(PyObject *where)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyObject *exc = raised();
    PyObject *before = PyErr_GetHandledException();
    PyErr_SetHandledException(exc);
    PyObject *done = PyObject_CallOneArg(hook_refs.internal_error, where);
    PyErr_SetHandledException(before);
    Py_XDECREF(before);
    Py_XDECREF(exc);
    if (done == NULL) {
        PyErr_Clear();  /* never raise ours into torch */
    }
    Py_XDECREF(done);
    return 0;
}

static int
read_clock(double *out)
{
    if (native_perf_counter) {  /* _PyTime_AsSecondsDouble's conversion */
        long long ns = clock_ns(CLOCK_MONOTONIC);
        if (ns < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        *out = ns % 1000000000LL == 0 ? (double)(ns / 1000000000LL) : (double)ns / 1e9;
        return 0;
    }
    PyObject *now = PyObject_CallNoArgs(hook_refs.perf_counter);
    if (now == NULL) {
        return -1;
    }
    *out = PyFloat_AsDouble(now);
    Py_DECREF(now);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

enum hook_kind { SERIALIZE, DESERIALIZE, RUN_FUNCTION, INVOKE_RPC };

typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *dict;  /* functools.update_wrapper's attributes, and _patching's */
    int kind;
    vectorcallfunc vectorcall;
} Hook;


static PyObject *s_server_sites, *s_span_name, *s_attributes, *s_start_server, *s_attach, *s_detach, *s_trace_id,
    *s_replies, *s_is_async, *s_func, *s_add_done_callback, *s_empty;

static int
intern_run_names(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_server_sites, "server_sites"}, {&s_span_name, "span_name"}, {&s_attributes, "attributes"},
        {&s_start_server, "start_server"}, {&s_attach, "attach"}, {&s_detach, "detach"}, {&s_trace_id, "trace_id"},
        {&s_replies, "replies"}, {&s_is_async, "is_async"}, {&s_func, "func"},
        {&s_add_done_callback, "add_done_callback"}, {&s_empty, ""},
        {&hook_refs.where_start, "server_start"}, {&hook_refs.where_detach, "server_detach"},
        {&hook_refs.where_end, "server_end"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* What one UDF run holds between its start and its end (server.py's locals). */
typedef struct {
    PyObject *fields, *site, *span, *token, *tracer, *thread;
    served_entry outer;  /* the serving table's entry for this thread before this run (a UDF that runs another) */
    serving_slot *slot;  /* this thread's, holding this run's entry; NULL: not entered */
    PyObject *span_serving, *span_outer;  /* Tracer.attach without a TracerProvider, inline: its table, what it held */
    serving_slot *span_slot;  /* that table is the C one: this thread's slot, holding this run's span */
    long long start_ns;
    double request_start;  /* perf_counter() when the request's unpickling started; 0.0 if not known */
    int tid;  /* a profiler is armed: the run ends through Serving.finish */
} run_state;

static void
run_state_clear(run_state *r)
{
    Py_CLEAR(r->fields);
    Py_CLEAR(r->site);
    Py_CLEAR(r->span);
    Py_CLEAR(r->token);
    Py_CLEAR(r->tracer);
    Py_CLEAR(r->thread);
    entry_release(&r->outer);
    Py_CLEAR(r->span_serving);
    Py_CLEAR(r->span_outer);
}

/* ---- Span and trace ids of the C paths (tracing._getrandbits, random.getrandbits, is their reference) ----
 * xoshiro256** seeded from getrandom(2), and seeded again in a forked child (as Python's random module is), so a
 * parent and its child never draw the same ids; drawn under the GIL. No call into Python and no int per draw beyond
 * the id itself. */
static uint64_t id_state[4];
static int ids_seeded;

static void
ids_after_fork(void)
{
    ids_seeded = 0;
}

static uint64_t
splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void
ids_seed(void)
{
    uint64_t seed[4];
    if (getrandom(seed, sizeof(seed), 0) != (ssize_t)sizeof(seed)) {  /* no entropy call: the clock, pid, stack */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = ((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32) ^
                     (uint64_t)(uintptr_t)&ts;
        for (int i = 0; i < 4; i++) {
            seed[i] = splitmix64(&x);
        }
    }
    if ((seed[0] | seed[1] | seed[2] | seed[3]) == 0) {
        seed[0] = 1;  /* the one state xoshiro never leaves */
    }
    memcpy(id_state, seed, sizeof(seed));
    ids_seeded = 1;
}

static uint64_t
rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* 64 random bits. */
static uint64_t
random_bits(void)
{
    if (!ids_seeded) {
        ids_seed();
    }
    uint64_t *s = id_state, result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3], s[2] ^= t, s[3] = rotl(s[3], 45);
    return result;
}

/* getrandbits(bits) for 64 or 128 bits: a C draw where no id source was configured, else the configured one. */
static PyObject *
random_id(int bits, PyObject *getrandbits, PyObject *bits_obj)
{
    if (getrandbits != Py_None) {
        return PyObject_CallOneArg(getrandbits, bits_obj);
    }
    if (bits == 64) {
        return PyLong_FromUnsignedLongLong(random_bits());
    }
    unsigned char bytes[16];  /* little-endian: the low 64 bits (what a ratio sampler reads) first */
    uint64_t low = random_bits(), high = random_bits();
    memcpy(bytes, &low, 8), memcpy(bytes + 8, &high, 8);
    return _PyLong_FromByteArray(bytes, 16, 1, 0);
}

PyDoc_STRVAR(random_id_doc,
"random_id(bits, /)\n--\n\n"
"A span (64) or trace (128) id as the C paths draw them without a configured id source: for tests.");

static PyObject *
random_id_function(PyObject *module, PyObject *arg)
{
    long bits = PyLong_AsLong(arg);
    if (bits != 64 && bits != 128) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "random_id(bits): bits is 64 or 128");
        return NULL;
    }
    return random_id((int)bits, Py_None, arg);
}

/* ---- Spans: Tracer.start_server, start_client, context_text, attach, detach and end (telemetry/tracing.py),
 * inline where they are plain ---- */

static struct {
    PyObject *span_type;  /* tracing.SpanRecord */
    PyObject *getrandbits;  /* None: the C draw (random_id); a test's in tests */
    PyObject *trace_module;  /* opentelemetry.trace: _TRACER_PROVIDER set means attach through its context */
    PyObject *get_current;  /* tracing._get_current: the current OpenTelemetry context */
    PyObject *span_key, *baggage_key;  /* where that context holds its span and its baggage */
    PyObject *traceparent_format, *flags;  /* propagation.TRACEPARENT_ENTRY_FORMAT, FLAGS */
    PyObject *bits64, *bits128, *server_kind, *client_kind, *zero;
} span_refs;

static PyObject *s_fast_propagation, *s_parent_based, *s_serving_attr, *s_tracer_provider, *s_end_ns, *s_queue,
    *s_max_queue, *s_sampled_attr, *s_limiter, *s_root_bound, *s_propagates, *s_span_id_attr,
    *s_trace_id_attr;
static PyObject *s_start_client;  /* interned with the invoke hook's names, below */

#define TRACEPARENT_ENTRY_SIZE 67  /* "traceparent=" vv-<32 hex>-<16 hex>-ff */

static int
lower_hex(const char *p, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) {
            return 0;
        }
    }
    return 1;
}

/* propagation.TRACEPARENT_ENTRY's fullmatch and parse_traceparent's checks: 1 and the ids as text if `entry` is a
 * valid `traceparent=...` entry with non-zero ids, 0 if not. */
static int
read_traceparent(PyObject *entry, const char **trace_hex, const char **parent_hex, int *sampled)
{
    if (!PyUnicode_CheckExact(entry) || !PyUnicode_IS_ASCII(entry) ||
        PyUnicode_GET_LENGTH(entry) != TRACEPARENT_ENTRY_SIZE) {
        return 0;
    }
    const char *p = (const char *)PyUnicode_DATA(entry);
    if (memcmp(p, "traceparent=", 12) != 0) {
        return 0;
    }
    p += 12;
    if (!lower_hex(p, 2) || (p[0] == 'f' && p[1] == 'f') || p[2] != '-' || !lower_hex(p + 3, 32) || p[35] != '-' ||
        !lower_hex(p + 36, 16) || p[52] != '-' || !lower_hex(p + 53, 2)) {
        return 0;
    }
    int trace_zero = 1, parent_zero = 1;
    for (int i = 0; i < 32; i++) {
        trace_zero &= p[3 + i] == '0';
    }
    for (int i = 0; i < 16; i++) {
        parent_zero &= p[36 + i] == '0';
    }
    if (trace_zero || parent_zero) {
        return 0;
    }
    char last = p[54];
    *sampled = ((last >= '0' && last <= '9') ? last - '0' : last - 'a' + 10) & 1;  /* SAMPLED_LAST_DIGITS */
    *trace_hex = p + 3;
    *parent_hex = p + 36;
    return 1;
}

/* The value of 16 lower-case hex digits (read_traceparent checked them). */
static uint64_t
hex64(const char *hex)
{
    uint64_t value = 0;
    for (int i = 0; i < 16; i++) {
        value = value << 4 | (uint64_t)(hex[i] <= '9' ? hex[i] - '0' : hex[i] - 'a' + 10);
    }
    return value;
}

/* int(hex, 16) of a checked span id (16 digits) or trace id (32), without parsing text as PyLong_FromString does. */
static PyObject *
hex_int(const char *hex, Py_ssize_t n)
{
    if (n == 16) {
        return PyLong_FromUnsignedLongLong(hex64(hex));
    }
    unsigned char bytes[16];  /* little-endian, as random_id builds a trace id */
    uint64_t high = hex64(hex), low = hex64(hex + 16);
    for (int i = 0; i < 8; i++) {
        bytes[i] = (unsigned char)(low >> (8 * i)), bytes[8 + i] = (unsigned char)(high >> (8 * i));
    }
    return _PyLong_FromByteArray(bytes, 16, 1, 0);
}

PyDoc_STRVAR(parse_traceparent_doc,
"parse_traceparent(entry, /)\n--\n\n"
"(trace_id, parent_id, sampled) of a `traceparent=...` carrier entry, or None: what Tracer.start_server reads\n"
"with propagation.TRACEPARENT_ENTRY (its reference).");

static PyObject *
parse_traceparent(PyObject *module, PyObject *entry)
{
    const char *trace_hex, *parent_hex;
    int sampled;
    if (!read_traceparent(entry, &trace_hex, &parent_hex, &sampled)) {
        Py_RETURN_NONE;
    }
    PyObject *trace_id = hex_int(trace_hex, 32), *parent_id = trace_id != NULL ? hex_int(parent_hex, 16) : NULL;
    PyObject *result = parent_id != NULL ? Py_BuildValue("(OOO)", trace_id, parent_id, sampled ? Py_True : Py_False)
                                         : NULL;
    Py_XDECREF(trace_id);
    Py_XDECREF(parent_id);
    return result;
}

/* An attribute's truth; -1 with an error. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    int truth = value != NULL ? PyObject_IsTrue(value) : -1;
    Py_XDECREF(value);
    return truth;
}

/* SpanRecord.__slots__, in the order its __init__ takes them, then the three it sets itself (end_ns = 0,
 * error_type = error_message = None, callee_ns = -1); their offsets in the instance, read from the type. */
static const char *const span_slots[] = {"name", "kind", "trace_id", "span_id", "parent_id", "remote_parent",
                                         "sampled", "attributes", "start_ns", "end_ns", "error_type",
                                         "error_message", "callee_ns"};
#define SPAN_SLOTS ((int)(sizeof(span_slots) / sizeof(span_slots[0])))
static Py_ssize_t span_offsets[SPAN_SLOTS];
static PyObject *minus_one;

/* 0 if `type` has exactly these object slots (its __slots__), their offsets kept; -1 (a TypeError) if not. */
static int
read_span_offsets(PyTypeObject *type)
{
    Py_ssize_t found[SPAN_SLOTS];
    int count = 0;
    for (PyMemberDef *m = type->tp_members; m != NULL && m->name != NULL; m++, count++) {
        int i = 0;
        while (i < SPAN_SLOTS && strcmp(m->name, span_slots[i]) != 0) {
            i++;
        }
        if (i == SPAN_SLOTS || m->type != T_OBJECT_EX || (m->flags & READONLY)) {
            count = -1;
            break;
        }
        found[i] = m->offset;
    }
    if (count != SPAN_SLOTS || type->tp_base != &PyBaseObject_Type) {
        PyErr_SetString(PyExc_TypeError, "configure_spans: span_type must be a class whose __slots__ are SpanRecord's");
        return -1;
    }
    memcpy(span_offsets, found, sizeof(found));
    return 0;
}

/* SpanRecord(name, kind, trace_id, a new span id, parent_id, remote_parent, sampled, attributes, start_ns), its
 * __init__ done here: the slots set as it sets them (tests/unit/test_core_spans.py holds the two together). */
static PyObject *
new_span(PyObject *name, PyObject *kind, PyObject *trace_id, PyObject *parent_id, PyObject *remote, PyObject *sampled,
         PyObject *attributes, PyObject *start)
{
    PyObject *span_id = random_id(64, span_refs.getrandbits, span_refs.bits64);
    if (span_id == NULL) {
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)span_refs.span_type;
    PyObject *span = type->tp_alloc(type, 0);
    if (span == NULL) {
        Py_DECREF(span_id);
        return NULL;
    }
    PyObject *values[SPAN_SLOTS] = {name, kind, trace_id, span_id, parent_id, remote, sampled, attributes, start,
                                    span_refs.zero, Py_None, Py_None, minus_one};
    for (int i = 0; i < SPAN_SLOTS; i++) {
        *(PyObject **)((char *)span + span_offsets[i]) = Py_NewRef(values[i]);
    }
    Py_DECREF(span_id);
    return span;
}

/* A slot of a span of span_refs.span_type read or written at its offset; another type (a test's record) by name. */
#define SPAN_SLOT(span, i) (*(PyObject **)((char *)(span) + span_offsets[i]))
static int
is_span_record(PyObject *span)
{
    return span_refs.span_type != NULL && Py_IS_TYPE(span, (PyTypeObject *)span_refs.span_type);
}

static int
span_set(PyObject *span, int i, PyObject *name, PyObject *value)
{
    if (!is_span_record(span)) {
        return PyObject_SetAttr(span, name, value);
    }
    Py_XSETREF(SPAN_SLOT(span, i), Py_NewRef(value));
    return 0;
}

/* What the inline span paths read of the tracer, read once per tracer: Tracer.__setattr__ calls
 * tracer_settings_changed (Tracer.settings_changed, set by server.configure_spans) when one of them is set again, so
 * the next span reads them anew. The tracer is held, so that no other object can take its address while cached. */
static struct {
    PyObject *tracer;  /* strong; NULL: nothing cached */
    PyObject *serving, *queue, *append;  /* strong; append: the queue's, bound once */
    Py_ssize_t max_queue;
    int fast_propagation, parent_based, propagates, limited;
    enum { ROOT_GENERAL, ROOT_ALL, ROOT_BELOW } roots;  /* _root_bound: not an int of [0, 2**64), so Python decides;
                                                          * above every trace id's low 64 bits; a bound of them */
    unsigned long long root_bound;  /* ROOT_BELOW */
} tracer_cache;

static void
forget_tracer(void)
{
    PyObject *tracer = tracer_cache.tracer, *serving = tracer_cache.serving, *queue = tracer_cache.queue;
    PyObject *append = tracer_cache.append;
    tracer_cache.tracer = tracer_cache.serving = tracer_cache.queue = tracer_cache.append = NULL;
    Py_XDECREF(serving);
    Py_XDECREF(queue);
    Py_XDECREF(append);
    Py_XDECREF(tracer);
}

/* The cache filled for `tracer`: 0, or -1 with an error (the cache left empty). */
static int
tracer_settings(PyObject *tracer)
{
    if (tracer_cache.tracer == tracer) {
        return 0;
    }
    forget_tracer();
    PyObject *serving = PyObject_GetAttr(tracer, s_serving_attr);
    PyObject *queue = serving != NULL ? PyObject_GetAttr(tracer, s_queue) : NULL;
    PyObject *append = queue != NULL ? PyObject_GetAttr(queue, s_append) : NULL;
    PyObject *bound = append != NULL ? PyObject_GetAttr(tracer, s_root_bound) : NULL;
    PyObject *max = bound != NULL ? PyObject_GetAttr(tracer, s_max_queue) : NULL;
    PyObject *limiter = max != NULL ? PyObject_GetAttr(tracer, s_limiter) : NULL;
    Py_ssize_t max_queue = limiter != NULL ? PyLong_AsSsize_t(max) : -1;
    int fast = -1, parent_based = -1, propagates = -1;
    if (!(max_queue == -1 && PyErr_Occurred()) && limiter != NULL &&
        (fast = attr_true(tracer, s_fast_propagation)) >= 0 && (parent_based = attr_true(tracer, s_parent_based)) >= 0) {
        propagates = attr_true(tracer, s_propagates);
    }
    int roots = ROOT_GENERAL;
    unsigned long long root_bound = 0;
    if (propagates >= 0 && PyLong_CheckExact(bound)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(bound, &overflow);  /* cannot fail on an exact int */
        if (overflow > 0) {
            root_bound = PyLong_AsUnsignedLongLong(bound);  /* 2**63 to 2**64 - 1, or (an error) above */
            roots = root_bound == (unsigned long long)-1 && PyErr_Occurred() ? ROOT_ALL : ROOT_BELOW;
            PyErr_Clear();
        }
        else if (overflow == 0 && value >= 0) {
            roots = ROOT_BELOW, root_bound = (unsigned long long)value;
        }
    }
    Py_XDECREF(bound);
    Py_XDECREF(max);
    if (propagates < 0) {
        Py_XDECREF(serving);
        Py_XDECREF(queue);
        Py_XDECREF(append);
        Py_XDECREF(limiter);
        return -1;
    }
    forget_tracer();  /* reading may have run code that filled it */
    tracer_cache.serving = serving, tracer_cache.queue = queue, tracer_cache.append = append;
    tracer_cache.max_queue = max_queue;
    tracer_cache.fast_propagation = fast, tracer_cache.parent_based = parent_based, tracer_cache.propagates = propagates;
    tracer_cache.limited = limiter != Py_None, tracer_cache.roots = roots, tracer_cache.root_bound = root_bound;
    tracer_cache.tracer = Py_NewRef(tracer);
    Py_DECREF(limiter);
    return 0;
}

PyDoc_STRVAR(tracer_settings_changed_doc,
"tracer_settings_changed()\n--\n\n"
"Forgets the tracer settings the inline span paths read once per tracer (Tracer.__setattr__ calls it).");

static PyObject *
tracer_settings_changed(PyObject *module, PyObject *unused)
{
    forget_tracer();
    Py_RETURN_NONE;
}

/* tracer.start_server(name, attributes, fields[4:], start_ns): inline for a caller that sent one valid traceparent to
 * a tracer that follows its flag (tracecontext/baggage propagators, a parentbased_ sampler); else the method. */
static PyObject *
start_server_span(PyObject *tracer, PyObject *name, PyObject *attributes, PyObject *fields, long long start_ns)
{
    const char *trace_hex, *parent_hex;
    int sampled = 0, fast = span_refs.span_type != NULL && fields != Py_None && PyList_GET_SIZE(fields) == 5 &&
                           read_traceparent(PyList_GET_ITEM(fields, 4), &trace_hex, &parent_hex, &sampled);
    if (fast) {
        if (tracer_settings(tracer) < 0) {
            return NULL;
        }
        fast = tracer_cache.fast_propagation && tracer_cache.parent_based;
    }
    PyObject *start = PyLong_FromLongLong(start_ns);
    if (start == NULL) {
        return NULL;
    }
    if (!fast) {
        PyObject *context = fields != Py_None ? PyList_GetSlice(fields, 4, PY_SSIZE_T_MAX) : Py_NewRef(Py_None);
        PyObject *span = context != NULL
            ? PyObject_CallMethodObjArgs(tracer, s_start_server, name, attributes, context, start, NULL) : NULL;
        Py_XDECREF(context);
        Py_DECREF(start);
        return span;
    }
    PyObject *trace_id = hex_int(trace_hex, 32), *parent_id = trace_id != NULL ? hex_int(parent_hex, 16) : NULL;
    PyObject *span = parent_id != NULL ? new_span(name, span_refs.server_kind, trace_id, parent_id, Py_True,
                                                  sampled ? Py_True : Py_False, attributes, start) : NULL;
    Py_XDECREF(trace_id);
    Py_XDECREF(parent_id);
    Py_DECREF(start);
    return span;
}

static PyObject *thread_key(PyObject **thread, unsigned long ident);

/* tracer.attach(span): without a TracerProvider, its per-thread entry inline (what was there kept in `r`). */
static int
attach_server_span(run_state *r)
{
    PyObject *provider = PyObject_GetAttr(span_refs.trace_module, s_tracer_provider);
    if (provider == NULL) {
        return -1;
    }
    int plain = provider == Py_None;
    Py_DECREF(provider);
    if (!plain) {
        return (r->token = PyObject_CallMethodOneArg(r->tracer, s_attach, r->span)) == NULL ? -1 : 0;
    }
    if (tracer_settings(r->tracer) < 0) {
        return -1;
    }
    r->span_serving = Py_NewRef(tracer_cache.serving);
    if (r->span_serving == (PyObject *)&serving_spans) {  /* this thread's slot (the C table of hooks.attach) */
        if ((r->span_slot = own_slot()) == NULL) {
            Py_CLEAR(r->span_serving);
            return -1;
        }
        r->span_outer = r->span_slot->span;  /* its reference moves to r */
        r->span_slot->span = Py_NewRef(r->span);
        return 0;
    }
    if (thread_key(&r->thread, PyThread_get_thread_ident()) == NULL) {
        Py_CLEAR(r->span_serving);
        return -1;
    }
    if (!PyDict_CheckExact(r->span_serving)) {
        Py_CLEAR(r->span_serving);
        return (r->token = PyObject_CallMethodOneArg(r->tracer, s_attach, r->span)) == NULL ? -1 : 0;
    }
    r->span_outer = PyDict_GetItemWithError(r->span_serving, r->thread);
    if (r->span_outer == NULL && PyErr_Occurred()) {
        return -1;
    }
    Py_XINCREF(r->span_outer);
    if (PyDict_SetItem(r->span_serving, r->thread, r->span) < 0) {
        Py_CLEAR(r->span_serving);  /* nothing to undo */
        return -1;
    }
    return 0;
}

/* tracer.detach(token) of the inline attach: what the thread's entry held before, back. */
static int
detach_server_span(run_state *r)
{
    if (r->span_serving == NULL) {
        return 0;
    }
    if (r->span_slot != NULL) {  /* what the slot held before, back; this run's span released with r */
        PyObject *span = r->span_slot->span;
        r->span_slot->span = r->span_outer;
        r->span_outer = span;
        r->span_slot = NULL;
        Py_CLEAR(r->span_serving);
        return 0;
    }
    int failed = r->span_outer != NULL ? PyDict_SetItem(r->span_serving, r->thread, r->span_outer)
                                       : PyDict_DelItem(r->span_serving, r->thread);
    if (failed < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
            return -1;
        }
        PyErr_Clear();  /* serving.pop(ident, None) */
    }
    Py_CLEAR(r->span_serving);
    return 0;
}

/* tracer.end(span, end_ns) of a span that ended without an error: queued if sampled and the queue has room, else
 * the method (which counts a full queue). */
static int
end_span(PyObject *tracer, PyObject *span, long long end_ns)
{
    PyObject *end = PyLong_FromLongLong(end_ns);
    if (end == NULL || span_set(span, SPAN_END_NS, s_end_ns, end) < 0) {
        Py_XDECREF(end);
        return -1;
    }
    PyObject *flag = GET(span, s_sampled_attr);
    int sampled = flag != NULL ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    if (sampled <= 0 || tracer_settings(tracer) < 0) {
        Py_DECREF(end);
        return sampled <= 0 ? sampled : -1;
    }
    /* held: len and append may run code that empties the cache */
    PyObject *queue = Py_NewRef(tracer_cache.queue), *append = Py_NewRef(tracer_cache.append);
    Py_ssize_t max_queue = tracer_cache.max_queue, size = PyObject_Length(queue);
    PyObject *done = NULL;
    if (size >= 0) {
        done = size < max_queue ? PyObject_CallOneArg(append, span)
                                : PyObject_CallMethodObjArgs(tracer, s_end, span, end, NULL);
    }
    Py_DECREF(queue);
    Py_DECREF(append);
    Py_DECREF(end);
    Py_XDECREF(done);
    return done != NULL ? 0 : -1;
}

/* The thread's id as an int, made the first time it is needed (`*thread`, owned by the caller); NULL with an error. */
static PyObject *
thread_key(PyObject **thread, unsigned long ident)
{
    if (*thread == NULL) {
        *thread = PyLong_FromUnsignedLong(ident);
    }
    return *thread;
}

/* tracer.start_client(name, attributes, start): inline for a call made while this thread serves a UDF (its SERVER
 * span is the parent) or with no current OpenTelemetry span and a ratio sampler (a root); else the method. */
static PyObject *
start_client_span(PyObject *tracer, PyObject *name, PyObject *attributes, PyObject *start, PyObject **thread,
                  unsigned long ident)
{
    PyObject *serving = NULL, *parent = NULL, *context = NULL, *span = NULL;
    if (span_refs.span_type == NULL || tracer_settings(tracer) < 0) {
        goto general;
    }
    serving = Py_NewRef(tracer_cache.serving);
    if (serving == (PyObject *)&serving_spans) {
        serving_slot *slot = slot_of_thread(ident);
        parent = slot != NULL ? slot->span : NULL;  /* borrowed */
    }
    else if (!PyDict_CheckExact(serving)) {
        goto general;
    }
    else if (PyDict_GET_SIZE(serving)) {
        if (thread_key(thread, ident) == NULL) {
            goto done;
        }
        parent = PyDict_GetItemWithError(serving, *thread);  /* borrowed */
        if (parent == NULL && PyErr_Occurred()) {
            goto done;
        }
    }
    if (parent != NULL) {  /* a child of the SERVER span this thread serves */
        Py_INCREF(parent);  /* held while its slots are read */
        PyObject *trace_id = GET(parent, s_trace_id_attr);
        PyObject *parent_id = trace_id != NULL ? GET(parent, s_span_id_attr) : NULL;
        PyObject *sampled = parent_id != NULL ? GET(parent, s_sampled_attr) : NULL;
        if (sampled != NULL) {
            span = new_span(name, span_refs.client_kind, trace_id, parent_id, Py_False, sampled, attributes, start);
        }
        Py_DECREF(parent);
        Py_XDECREF(trace_id);
        Py_XDECREF(parent_id);
        Py_XDECREF(sampled);
        goto done;
    }
    if ((context = PyObject_CallNoArgs(span_refs.get_current)) == NULL) {
        goto done;
    }
    if (!PyDict_Check(context)) {
        goto general;
    }
    PyObject *current = PyDict_GetItemWithError(context, span_refs.span_key);  /* borrowed */
    if (current == NULL && PyErr_Occurred()) {
        goto done;
    }
    if ((current != NULL && current != Py_None) || tracer_settings(tracer) < 0 || tracer_cache.limited ||
        tracer_cache.roots == ROOT_GENERAL) {
        goto general;  /* an OpenTelemetry span is current, or the rate limiter decides */
    }
    /* a root: trace_id = getrandbits(128); sampled = (trace_id & _LOW_64) < _root_bound */
    int all = tracer_cache.roots == ROOT_ALL;
    unsigned long long bound = tracer_cache.root_bound;
    PyObject *trace_id = random_id(128, span_refs.getrandbits, span_refs.bits128);
    unsigned long long low = trace_id != NULL ? PyLong_AsUnsignedLongLongMask(trace_id) : (unsigned long long)-1;
    if (trace_id != NULL && !(low == (unsigned long long)-1 && PyErr_Occurred())) {
        span = new_span(name, span_refs.client_kind, trace_id, span_refs.zero, Py_False,
                        all || low < bound ? Py_True : Py_False, attributes, start);
    }
    Py_XDECREF(trace_id);
    goto done;
general:
    if (!PyErr_Occurred()) {
        span = PyObject_CallMethodObjArgs(tracer, s_start_client, name, attributes, start, NULL);
    }
done:
    Py_XDECREF(serving);
    Py_XDECREF(context);
    return span;
}

/* TRACEPARENT_ENTRY_FORMAT cut at its three values (%032x, %016x, %s), by configure_spans: the inline entry writes
 * its pieces and the values, with no tuple and no format run. */
#define TRACEPARENT_PIECE 48
static struct {
    char text[4][TRACEPARENT_PIECE];
    Py_ssize_t len[4];
    int cut;  /* 0: the format is not of that shape; the entry is always formatted by Python */
} traceparent_pieces;

static void
cut_traceparent_format(PyObject *format)
{
    static const char *values[3] = {"%032x", "%016x", "%s"};
    Py_ssize_t size;
    const char *text = PyUnicode_Check(format) && PyUnicode_IS_ASCII(format) ? PyUnicode_AsUTF8AndSize(format, &size)
                                                                               : NULL;
    traceparent_pieces.cut = 0;
    if (text == NULL) {
        PyErr_Clear();
        return;
    }
    const char *at = text, *end = text + size;
    for (int i = 0; i < 4; i++) {
        const char *value = i < 3 ? strstr(at, values[i]) : end;
        if (value == NULL || value - at >= TRACEPARENT_PIECE || memchr(at, '%', (size_t)(value - at)) != NULL) {
            return;
        }
        memcpy(traceparent_pieces.text[i], at, (size_t)(value - at));
        traceparent_pieces.len[i] = value - at;
        at = i < 3 ? value + strlen(values[i]) : end;
    }
    traceparent_pieces.cut = 1;
}

/* The traceparent entry of these ids and flag, written from the cut format; NULL with no error: not writable here
 * (an id out of range or not an exact int, a flag not ASCII text), so the caller formats it. */
static PyObject *
traceparent_entry(PyObject *trace_id, PyObject *span_id, PyObject *flag)
{
    char trace[32], span[16];
    if (!traceparent_pieces.cut || !PyUnicode_Check(flag) || !PyUnicode_IS_ASCII(flag) ||
        !id_hex(trace_id, trace, 16) || !id_hex(span_id, span, 8)) {
        return NULL;
    }
    Py_ssize_t flag_len = PyUnicode_GET_LENGTH(flag), size = 32 + 16 + flag_len;
    for (int i = 0; i < 4; i++) {
        size += traceparent_pieces.len[i];
    }
    PyObject *entry = PyUnicode_New(size, 127);
    if (entry == NULL) {
        return NULL;
    }
    char *p = (char *)PyUnicode_1BYTE_DATA(entry);
    const char *parts[3] = {trace, span, (const char *)PyUnicode_1BYTE_DATA(flag)};
    const Py_ssize_t lens[3] = {32, 16, flag_len};
    for (int i = 0; i < 4; i++) {
        memcpy(p, traceparent_pieces.text[i], (size_t)traceparent_pieces.len[i]), p += traceparent_pieces.len[i];
        if (i < 3) {
            memcpy(p, parts[i], (size_t)lens[i]), p += lens[i];
        }
    }
    return entry;
}

/* tracer.context_text(span): the traceparent entry formatted inline when the propagators are tracecontext/baggage and
 * no baggage is current; else the method. */
static PyObject *
client_context_text(PyObject *tracer, PyObject *span)
{
    if (span_refs.span_type == NULL) {
        return PyObject_CallMethodOneArg(tracer, s_context_text, span);
    }
    if (tracer_settings(tracer) < 0) {
        return NULL;
    }
    int fast = tracer_cache.fast_propagation;
    if (!tracer_cache.propagates) {
        return PyUnicode_FromStringAndSize(NULL, 0);
    }
    PyObject *context = fast ? PyObject_CallNoArgs(span_refs.get_current) : NULL;
    if (fast && context == NULL) {
        return NULL;
    }
    int baggage = context != NULL ? PySequence_Contains(context, span_refs.baggage_key) : 1;
    Py_XDECREF(context);
    if (baggage < 0) {
        return NULL;
    }
    if (baggage) {
        return PyObject_CallMethodOneArg(tracer, s_context_text, span);
    }
    /* TRACEPARENT_ENTRY_FORMAT % (span.trace_id, span.span_id, FLAGS[span.sampled]) */
    PyObject *trace_id = GET(span, s_trace_id_attr);
    PyObject *span_id = trace_id != NULL ? GET(span, s_span_id_attr) : NULL;
    PyObject *sampled = span_id != NULL ? GET(span, s_sampled_attr) : NULL;
    PyObject *flag = sampled != NULL ? PyObject_GetItem(span_refs.flags, sampled) : NULL;
    PyObject *text = flag != NULL ? traceparent_entry(trace_id, span_id, flag) : NULL;
    PyObject *values = flag != NULL && text == NULL && !PyErr_Occurred() ? PyTuple_Pack(3, trace_id, span_id, flag)
                                                                         : NULL;
    if (values != NULL) {  /* ids or a flag the inline entry does not write: the format itself */
        text = PyUnicode_Format(span_refs.traceparent_format, values);
    }
    Py_XDECREF(trace_id);
    Py_XDECREF(span_id);
    Py_XDECREF(sampled);
    Py_XDECREF(flag);
    Py_XDECREF(values);
    return text;
}

PyDoc_STRVAR(configure_spans_doc,
"configure_spans(span_type, getrandbits, trace_module, get_current, span_key, baggage_key, traceparent_format,\n"
"                flags, /)\n--\n\n"
"Hands the inline span starts tracing.py's SpanRecord type, id source (None: their own, random_id), opentelemetry.trace,\n"
"current-context getter"
"and keys, and propagation.py's traceparent entry format and flags (server.py, at import).");

static PyObject *
configure_spans(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !PyType_Check(args[0]) || !PyUnicode_Check(args[6]) || !PyTuple_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "configure_spans(span_type: type, getrandbits, trace_module, get_current, "
                                         "span_key, baggage_key, traceparent_format: str, flags: tuple)");
        return NULL;
    }
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_fast_propagation, "_fast_propagation"}, {&s_parent_based, "_parent_based"}, {&s_serving_attr, "serving"},
        {&s_tracer_provider, "_TRACER_PROVIDER"}, {&s_end_ns, "end_ns"}, {&s_queue, "_queue"},
        {&s_max_queue, "_max_queue"}, {&s_sampled_attr, "sampled"},
        {&s_limiter, "_limiter"}, {&s_root_bound, "_root_bound"}, {&s_propagates, "_propagates"},
        {&s_span_id_attr, "span_id"}, {&s_trace_id_attr, "trace_id"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return NULL;
        }
    }
    if ((span_refs.bits64 == NULL && (span_refs.bits64 = PyLong_FromLong(64)) == NULL) ||
        (span_refs.bits128 == NULL && (span_refs.bits128 = PyLong_FromLong(128)) == NULL) ||
        (span_refs.server_kind == NULL && (span_refs.server_kind = PyLong_FromLong(2)) == NULL) ||  /* SERVER */
        (span_refs.client_kind == NULL && (span_refs.client_kind = PyLong_FromLong(3)) == NULL) ||  /* CLIENT */
        (span_refs.zero == NULL && (span_refs.zero = PyLong_FromLong(0)) == NULL) ||
        (minus_one == NULL && (minus_one = PyLong_FromLong(-1)) == NULL) ||
        read_span_offsets((PyTypeObject *)args[0]) < 0) {
        return NULL;
    }
    PyObject **slots[] = {&span_refs.span_type, &span_refs.getrandbits, &span_refs.trace_module,
                          &span_refs.get_current, &span_refs.span_key, &span_refs.baggage_key,
                          &span_refs.traceparent_format, &span_refs.flags};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    cut_traceparent_format(span_refs.traceparent_format);
    Py_RETURN_NONE;
}

/* The site of this run: (func, src, mode) looked up inline; an RRef proxy, an unhashable func or a miss: Python. */
static PyObject *
run_site(PyObject *runtime, PyObject *udf, PyObject *fields)
{
    PyObject *func = PyObject_GetAttr(udf, s_func), *key = NULL, *sites = NULL, *site = NULL;
    if (func == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return NULL;
        }
        PyErr_Clear();
        func = Py_NewRef(Py_None);  /* the UDF could not be unpickled */
    }
    int proxy = PySequence_Contains(hook_refs.proxies, func);
    if (proxy != 0) {
        PyErr_Clear();  /* a proxy, or unhashable: the general lookup */
        goto general;
    }
    if (fields != Py_None) {
        if (!PyList_Check(fields) || PyList_GET_SIZE(fields) < 4) {
            goto general;
        }
        key = PyTuple_Pack(3, func, PyList_GET_ITEM(fields, 1), PyList_GET_ITEM(fields, 2));
    }
    else {
        key = PyTuple_Pack(3, func, hook_refs.unknown, hook_refs.unknown);
    }
    if (key == NULL || (sites = GET(runtime, s_server_sites)) == NULL) {
        goto done;
    }
    site = PyDict_Check(sites) ? PyDict_GetItemWithError(sites, key) : NULL;
    if (site != NULL) {
        Py_INCREF(site);
        goto done;
    }
    PyErr_Clear();  /* unhashable args of the key, or a miss */
general:
    site = PyObject_CallFunctionObjArgs(hook_refs.site_of, runtime, udf, fields, NULL);
done:
    Py_DECREF(func);
    Py_XDECREF(key);
    Py_XDECREF(sites);
    return site;
}

/* server._run_function's start: the site, the SERVER span made current, the serving table. 0, or -1 with an error. */
static int
run_start(PyObject *runtime, PyObject *udf, run_state *r)
{
    if (incoming.udf != NULL && incoming.udf == udf) {  /* the request this thread just unpickled */
        PyObject *held = incoming.udf;
        r->fields = incoming.fields, r->request_start = incoming.start;
        incoming.udf = incoming.fields = NULL;
        Py_DECREF(held);  /* torch holds it too: never the last reference */
    }
    else if ((r->fields = PyObject_GetAttr(udf, s_fields)) != NULL) {  /* an _IncomingUDF of the Python path */
        PyObject *start = PyObject_GetAttr(udf, s_start);  /* getattr(python_udf, "rpc_observe_start", 0.0) */
        if (start == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            start = PyFloat_FromDouble(0.0);
        }
        r->request_start = start != NULL ? PyFloat_AsDouble(start) : -1.0;
        Py_XDECREF(start);
        if (r->request_start == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    else {  /* no trailer (a peer without rpc_observe), or a request unpickled elsewhere */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        r->fields = Py_NewRef(Py_None);
    }
    if (r->fields != Py_None && (!PyList_Check(r->fields) || PyList_GET_SIZE(r->fields) < 4)) {
        PyErr_SetString(PyExc_TypeError, "rpc_observe_fields is not a request's fields");
        return -1;
    }
    if ((r->site = run_site(runtime, udf, r->fields)) == NULL) {
        return -1;
    }
    if ((r->start_ns = now_ns()) == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *profiler = NULL, *armed = NULL;
    if ((r->tracer = GET(runtime, s_tracer)) == NULL) {
        return -1;
    }
    if (r->tracer != Py_None) {
        PyObject *name = GET(r->site, s_span_name), *attributes = GET(r->site, s_attributes);
        if (name != NULL && attributes != NULL) {
            r->span = start_server_span(r->tracer, name, attributes, r->fields, r->start_ns);
        }
        Py_XDECREF(name);
        Py_XDECREF(attributes);
        if (r->span == NULL || attach_server_span(r) < 0) {
            return -1;
        }
    }
    else {
        r->span = Py_NewRef(Py_None);
    }
    if ((profiler = GET(runtime, s_profiler)) == NULL) {
        return -1;
    }
    if (profiler != Py_None) {
        armed = GET(profiler, s_armed);
        r->tid = armed != NULL ? PyObject_IsTrue(armed) : -1;
    }
    Py_DECREF(profiler);
    Py_XDECREF(armed);
    if (r->tid < 0) {
        return -1;
    }
    serving_slot *slot = own_slot();  /* the serving table: this run's entry, what was there kept */
    if (slot == NULL) {
        return -1;
    }
    PyObject *trace_id = r->span != Py_None ? GET(r->span, s_trace_id) : PyLong_FromLong(0);
    if (trace_id == NULL) {
        return -1;
    }
    r->outer = (served_entry){Py_NewRef(r->site), Py_NewRef(r->fields != Py_None ? PyList_GET_ITEM(r->fields, 3)
                                                                                  : s_empty), trace_id, r->start_ns};
    slot_swap(slot, &r->outer);
    r->slot = slot;
    return 0;
}

/* server._run_function's finally: the serving table as it was, the span no longer current. */
static int
run_detach(run_state *r)
{
    if (r->slot != NULL) {  /* the entry before this run, back; this run's, in r->outer, released with it */
        slot_swap(r->slot, &r->outer);
        r->slot = NULL;
    }
    if (detach_server_span(r) < 0) {
        return -1;
    }
    if (r->token != NULL) {
        PyObject *done = PyObject_CallMethodOneArg(r->tracer, s_detach, r->token);
        if (done == NULL) {
            return -1;
        }
        Py_DECREF(done);
    }
    return 0;
}

/* server._run_function's end of a plain successful run (Serving.finish, inline), and the response's echo. */
static int
run_end(PyObject *runtime, PyObject *result, run_state *r)
{
    PyObject *is_async = GET(r->site, s_is_async);
    if (is_async == NULL) {
        return -1;
    }
    int async_run = PyObject_IsTrue(is_async);
    Py_DECREF(is_async);
    if (async_run < 0) {
        return -1;
    }
    if ((async_run && PyObject_HasAttr(result, s_add_done_callback)) ||
        Py_IS_TYPE(result, (PyTypeObject *)refs.remote_exception) || r->tid) {
        PyObject *start = PyLong_FromLongLong(r->start_ns), *request_start = PyFloat_FromDouble(r->request_start);
        PyObject *done = start != NULL && request_start != NULL
            ? PyObject_CallFunctionObjArgs(hook_refs.end_other, runtime, r->site, start, r->span, r->tid ? Py_True
                                           : Py_False, result, r->fields, request_start, NULL)
            : NULL;
        Py_XDECREF(start);
        Py_XDECREF(request_start);
        Py_XDECREF(done);
        return done != NULL ? 0 : -1;
    }
    long long end_ns = now_ns();
    if (end_ns == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *record = GET(r->site, s_record);
    if (record == NULL) {
        return -1;
    }
    if (record != Py_None) {
        PyObject *cells = GET(r->site, s_cells);
        crecord served = {FOLD_SERVED, cells, r->span, {0}, {(double)(end_ns - r->start_ns) / 1e9, 0.0}};
        int failed = cells == NULL || push_record(record, &served) < 0;
        Py_XDECREF(cells);
        if (failed) {
            Py_DECREF(record);
            return -1;
        }
    }
    Py_DECREF(record);
    if (r->span != Py_None && end_span(r->tracer, r->span, end_ns) < 0) {
        return -1;
    }
    PyObject *replies = GET(r->site, s_replies);
    if (replies == NULL) {
        return -1;
    }
    int reply = PyObject_IsTrue(replies);
    Py_DECREF(replies);
    if (reply <= 0) {
        return reply;
    }
    /* (site, the caller's call id or "", the request's start: 0.0 without fields) */
    owe_reply(r->site, r->fields != Py_None ? PyList_GET_ITEM(r->fields, 3) : s_empty, r->request_start);
    return 0;
}

/* internal._run_function(python_udf), wrapped: server.py's `_run_function`, step for step. */
static PyObject *
run_function_call(Hook *self, PyObject *runtime, PyObject *const *args, size_t nargsf)
{
    PyObject *udf = args[0];
    run_state r = {0};
    if (run_start(runtime, udf, &r) < 0) {
        int swallowed = swallow(hook_refs.where_start);
        if (swallowed == 0 && run_detach(&r) < 0) {  /* what the start did, undone: the thread is as it was */
            swallowed = swallow(hook_refs.where_detach);
        }
        run_state_clear(&r);
        return swallowed < 0 ? NULL : PyObject_Vectorcall(self->original, args, nargsf, NULL);
    }
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, NULL);
    PyObject *raised_exc = result == NULL ? raised() : NULL;  /* torch's, raised again after the finally */
    if (run_detach(&r) < 0 && swallow(hook_refs.where_detach) < 0) {
        Py_XDECREF(raised_exc);
        Py_XDECREF(result);
        run_state_clear(&r);
        return NULL;
    }
    if (result == NULL) {
        if (raised_exc == NULL) {
            PyErr_SetString(PyExc_SystemError, "_run_function failed without an exception");
        }
        else {
            PyErr_SetRaisedException_compat(raised_exc);
        }
        run_state_clear(&r);
        return NULL;
    }
    if (run_end(runtime, result, &r) < 0 && swallow(hook_refs.where_end) < 0) {
        Py_DECREF(result);
        result = NULL;
    }
    run_state_clear(&r);
    return result;
}


/* ---- rpc_sync / rpc_async: api._invoke_rpc, and the `Call` each call makes (calls.Call.__init__, in C) ---- */

static struct {
    PyObject *call_type;  /* calls.Call */
    PyObject *begin;  /* client._begin(runtime, to, func, mode, udf_args): a Call for a site not yet made */
    PyObject *end_raised;  /* calls.end_raised(call, error) */
    PyObject *after_invoke;  /* client._after_invoke(call, future, rpc_type): what the caller gets */
    PyObject *profiler_enabled;  /* torch.autograd._profiler_enabled */
    PyObject *native_id;  /* threading.get_native_id */
    PyObject *empty_tuple;
    PyObject *where_start, *where_watch;  /* "client_start", "client_watch" */
} invoke_refs;

static PyObject *s_start_client, *s_client_start, *s_key,
    *s_started, *s_client_sites, *s_value_, *s_args_kw, *s_swept, *s_client_end_on;

static int
intern_invoke_names(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_start_client, "start_client"}, {&s_client_start, "client_start"}, {&s_key, "key"},
        {&s_started, "started"}, {&s_client_sites, "client_sites"}, {&s_value_, "_value_"}, {&s_args_kw, "args"},
        {&s_swept, "swept"}, {&s_client_end_on, "client_end_on"},
        {&invoke_refs.where_start, "client_start"}, {&invoke_refs.where_watch, "client_watch"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return -1;
        }
    }
    return (invoke_refs.empty_tuple == NULL && (invoke_refs.empty_tuple = PyTuple_New(0)) == NULL) ? -1 : 0;
}

PyDoc_STRVAR(new_call_doc,
"new_call(runtime, site, /)\n--\n\n"
"calls.Call(runtime, site), made in C: the same slots, set the same way (calls.Call.__init__ is its reference).");

static PyObject *
new_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || invoke_refs.call_type == NULL || hook_refs.serving == NULL) {
        PyErr_SetString(PyExc_TypeError, "new_call(runtime, site), after configure_invoke and configure_run");
        return NULL;
    }
    PyObject *runtime = args[0], *site = args[1];
    PyTypeObject *type = (PyTypeObject *)invoke_refs.call_type;  /* a subclass of CallBase (configure_invoke) */
    CallObject *call = (CallObject *)type->tp_alloc(type, 0);
    if (call == NULL) {
        return NULL;
    }
    PyObject *tracer = NULL, *profiler = NULL, *record = NULL, *thread = NULL;
    call->runtime = Py_NewRef(runtime);
    call->site = Py_NewRef(site);
    call->future = Py_NewRef(Py_None);
    call->thread = PyThread_get_thread_ident();
    if ((call->start_ns = now_ns()) == -1 && PyErr_Occurred()) {
        goto failed;
    }
    /* the UDF this call waits inside, if any */
    serving_slot *slot = slot_of_thread(call->thread);
    if (slot != NULL && slot->udf.site != NULL) {
        if ((call->parent = slot_tuple(slot)) == NULL) {
            goto failed;
        }
    }
    else {
        call->parent = Py_NewRef(Py_None);
    }
    if ((tracer = GET(runtime, s_tracer)) == NULL || (profiler = GET(runtime, s_profiler)) == NULL) {
        goto failed;
    }
    if (tracer != Py_None) {
        PyObject *name = GET(site, s_span_name), *attributes = GET(site, s_attributes);
        PyObject *start = name != NULL && attributes != NULL ? PyLong_FromLongLong(call->start_ns) : NULL;
        call->span = start != NULL ? start_client_span(tracer, name, attributes, start, &thread, call->thread) : NULL;
        Py_XDECREF(name);
        Py_XDECREF(attributes);
        Py_XDECREF(start);
        if (call->span == NULL) {
            goto failed;
        }
    }
    else {
        call->span = Py_NewRef(Py_None);
    }
    if (profiler != Py_None) {
        PyObject *enabled = PyObject_CallNoArgs(invoke_refs.profiler_enabled);
        int on = enabled != NULL ? PyObject_IsTrue(enabled) : -1;
        Py_XDECREF(enabled);
        if (on < 0) {
            goto failed;
        }
        if (on) {
            PyObject *key = GET(site, s_key);
            call->rf = key != NULL ? PyObject_CallMethodOneArg(profiler, s_client_start, key) : NULL;
            Py_XDECREF(key);
            if (call->rf == NULL) {
                goto failed;
            }
        }
        else {
            call->rf = Py_NewRef(Py_None);
        }
        PyObject *armed = GET(profiler, s_armed);
        int is_armed = armed != NULL ? PyObject_IsTrue(armed) : -1;
        Py_XDECREF(armed);
        if (is_armed < 0) {
            goto failed;
        }
        if (is_armed) {
            PyObject *tid = PyObject_CallNoArgs(invoke_refs.native_id);
            call->tid = tid != NULL ? PyLong_AsLongLong(tid) : -1;
            Py_XDECREF(tid);
            if (call->tid == -1 && PyErr_Occurred()) {
                goto failed;
            }
        }
    }
    else {
        call->rf = Py_NewRef(Py_None);
    }
    if ((record = GET(site, s_record)) == NULL) {
        goto failed;
    }
    if (record != Py_None) {
        PyObject *started = GET(site, s_started);
        PyObject *done = started != NULL ? PyObject_CallOneArg(record, started) : NULL;
        Py_XDECREF(started);
        if (done == NULL) {
            goto failed;
        }
        Py_DECREF(done);
    }
    Py_DECREF(tracer);
    Py_DECREF(profiler);
    Py_DECREF(record);
    Py_XDECREF(thread);
    return (PyObject *)call;
failed:
    Py_XDECREF(tracer);
    Py_XDECREF(profiler);
    Py_XDECREF(record);
    Py_XDECREF(thread);
    Py_DECREF(call);
    return NULL;
}

/* The Call of this invocation: its site looked up inline by (func, mode, to), else client._begin; NULL (no
 * error) if none is to be made, NULL with an error if making it failed. */
static PyObject *
invoke_call(PyObject *runtime, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *to = args[0], *func = args[1], *mode = PyObject_GetAttr(args[2], s_value_), *site = NULL;
    if (mode == NULL) {
        return NULL;
    }
    if (PyUnicode_CheckExact(to)) {
        PyObject *sites = GET(runtime, s_client_sites), *key = PyTuple_Pack(3, func, mode, to);
        if (sites != NULL && key != NULL && PyDict_Check(sites)) {
            site = PyDict_GetItemWithError(sites, key);
            Py_XINCREF(site);
            if (site == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();  /* an unhashable func */
            }
        }
        Py_XDECREF(sites);
        Py_XDECREF(key);
        if (PyErr_Occurred()) {
            Py_XDECREF(site);
            Py_DECREF(mode);
            return NULL;
        }
    }
    PyObject *call;
    if (site != NULL) {
        PyObject *call_args[2] = {runtime, site};
        call = new_call(NULL, call_args, 2);
        Py_DECREF(site);
    }
    else {  /* udf args: args[3] if given by position, else the `args` keyword */
        PyObject *udf_args = nargs > 3 ? args[3] : Py_None;
        if (nargs <= 3 && kwnames != NULL) {
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
                if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), s_args_kw) == 0) {
                    udf_args = args[nargs + i];
                }
            }
        }
        call = PyObject_CallFunctionObjArgs(invoke_refs.begin, runtime, to, func, mode, udf_args, NULL);
        if (call == Py_None) {
            Py_CLEAR(call);  /* _begin counted what went wrong */
        }
    }
    Py_DECREF(mode);
    return call;
}

/* site.swept (client.ClientSite): 1 (also for no site: _after_invoke's way), 0, or -1 with an error set. */
static int
is_swept(PyObject *site)
{
    if (site == NULL) {
        return 1;
    }
    PyObject *swept = GET(site, s_swept);
    int value = swept != NULL ? PyObject_IsTrue(swept) : -1;
    Py_XDECREF(swept);
    return value;
}

/* api._invoke_rpc(to, func, rpc_type, *args, **kwargs), wrapped: client.py's `_invoke_rpc`, step for step. */
static PyObject *
invoke_rpc_call(Hook *self, PyObject *runtime, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *call = invoke_call(runtime, args, nargs, kwnames);
    if (call == NULL) {
        if (PyErr_Occurred() && swallow(invoke_refs.where_start) < 0) {
            return NULL;
        }
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }
    PyObject *outer = thread_call;  /* local.call = call, the outer one kept (its reference moves here) */
    thread_call = Py_NewRef(call);
    PyObject *future = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    PyObject *error = future == NULL ? raised() : NULL;
    Py_XSETREF(thread_call, outer);  /* local.call = outer */
    if (future == NULL) {  /* torch raised before the call had a future: ended as failed, then raised as it is */
        if (error == NULL) {
            PyErr_SetString(PyExc_SystemError, "_invoke_rpc failed without an exception");
            Py_DECREF(call);
            return NULL;
        }
        PyObject *done = PyObject_CallFunctionObjArgs(invoke_refs.end_raised, call, error, NULL);
        Py_XDECREF(done);
        if (done == NULL) {
            PyErr_Clear();  /* end_raised counts its own errors; torch's exception goes on */
        }
        Py_DECREF(call);
        PyErr_SetRaisedException_compat(error);
        return NULL;
    }
    /* its echoed response ends it (the common case, inline), else _after_invoke watches the future */
    CallObject *fields = AS_CALL(call);  /* client._begin's Call: always one where the core is built */
    PyObject *result = NULL;
    int echoed = fields != NULL && fields->id != 0, profiled = echoed && fields->rf != NULL && fields->rf != Py_None;
    int swept = 0;
    if (echoed && !profiled) {
        Py_XSETREF(fields->future, Py_NewRef(future));
        result = Py_NewRef(future);
    }
    else if (echoed && (swept = is_swept(fields->site)) == 0) {
        /* _after_invoke, inline, for a call with torch's profiler event on a site that is not swept: the
         * future torch's own profiling path returns, which completes only once the event is ended */
        PyObject *profiler = GET(runtime, s_profiler);
        if (profiler != NULL) {
            Py_XSETREF(fields->future, Py_NewRef(future));
            result = PyObject_CallMethodObjArgs(profiler, s_client_end_on, fields->rf, future, fields->site, NULL);
            Py_DECREF(profiler);
        }
    }
    else if (swept < 0) {
        result = NULL;  /* reading `swept` failed: counted below, as _after_invoke's own errors are */
    }
    else {
        result = PyObject_CallFunctionObjArgs(invoke_refs.after_invoke, call, future, args[2], NULL);
    }
    Py_DECREF(call);
    if (result == NULL) {
        result = swallow(invoke_refs.where_watch) < 0 ? NULL : Py_NewRef(future);
    }
    Py_DECREF(future);
    return result;
}

PyDoc_STRVAR(configure_invoke_doc,
"configure_invoke(call_type, begin, end_raised, after_invoke, profiler_enabled, native_id, /)\n--\n\n"
"Hands the _invoke_rpc Hook and new_call client.py's and calls.py's helpers (client.py calls it once).");

static PyObject *
configure_invoke(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyType_Check(args[0]) || !PyType_IsSubtype((PyTypeObject *)args[0], &CallBaseType)) {
        PyErr_SetString(PyExc_TypeError, "configure_invoke(call_type: a subclass of CallBase, begin, end_raised, "
                                         "after_invoke, profiler_enabled, native_id)");
        return NULL;
    }
    PyObject **slots[] = {&invoke_refs.call_type, &invoke_refs.begin, &invoke_refs.end_raised,
                          &invoke_refs.after_invoke, &invoke_refs.profiler_enabled, &invoke_refs.native_id};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    Py_RETURN_NONE;
}

/* torch's RPC pool threads keep their Python thread state (thread_states.py is the reference and says why). Each
 * time one of these C++ threads takes the GIL (pybind11's gil_scoped_acquire), CPython makes it a new thread state
 * and deletes it at the release: a state allocated, its frame stack mapped, faulted in and unmapped, 2-3 times per
 * RPC on the callee. One reference more on the state, taken where a hook first runs on the thread and never given
 * back, makes pybind11 keep it and take the GIL with it from then on. */
static int keep_thread_states;  /* keep_thread_states(flag): the runtime's RPC_OBSERVE_KEEP_THREAD_STATES */
static __thread char thread_state_seen;  /* this thread's state was kept (or is not one to keep) */

static void
keep_thread_state(void)
{
    thread_state_seen = 1;
    /* PyGILState_Ensure on the state this thread already runs with only counts a reference: it takes no lock. A
     * state that is not the thread's PyGILState one (a sub-interpreter's) is left as it is. */
    if (PyGILState_GetThisThreadState() == PyThreadState_Get()) {
        (void)PyGILState_Ensure();
    }
}

PyDoc_STRVAR(keep_thread_states_doc,
"keep_thread_states(keep, /)\n--\n\n"
"Whether the hooks keep the Python thread state of the threads they run on (thread_states.configure).");

static PyObject *
set_keep_thread_states(PyObject *module, PyObject *keep)
{
    int flag = PyObject_IsTrue(keep);
    if (flag < 0) {
        return NULL;
    }
    keep_thread_states = flag;
    Py_RETURN_NONE;
}

/* _run_function in an empty contextvars context, as it runs on a new thread state: what a UDF sets in one is never
 * seen by the next UDF the kept thread state runs. */
static PyObject *
run_in_new_context(Hook *self, PyObject *runtime, PyObject *const *args, size_t nargsf)
{
    PyObject *context = PyContext_New();
    if (context == NULL || PyContext_Enter(context) < 0) {
        Py_XDECREF(context);
        return swallow(hook_refs.where_start) < 0 ? NULL : run_function_call(self, runtime, args, nargsf);
    }
    PyObject *result = run_function_call(self, runtime, args, nargsf);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);  /* a KeyboardInterrupt through the UDF: raised again below */
    if (PyContext_Exit(context) < 0) {
        (void)swallow(hook_refs.where_detach);  /* a RuntimeError (another context left entered): counted */
    }
    PyErr_Restore(type, value, traceback);
    Py_DECREF(context);
    return result;
}

static PyObject *
hook_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hook *self = (Hook *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* (pickler, obj), (pickler, data, tensors), (python_udf) or (to, func, rpc_type, ...) */
    Py_ssize_t wanted = self->kind == SERIALIZE ? 2 : self->kind == DESERIALIZE ? 3 : self->kind == RUN_FUNCTION ? 1 : 3;
    PyObject *runtime = NULL;
    int configured = hook_refs.runtime_module != NULL && refs.not_handled != NULL &&  /* pickler.py's configure, */
                     (self->kind <= DESERIALIZE || hook_refs.serving != NULL) &&  /* server.py's, */
                     (self->kind != INVOKE_RPC || invoke_refs.call_type != NULL);  /* client.py's */
    int fits = self->kind == INVOKE_RPC ? nargs >= wanted : kwnames == NULL && nargs == wanted;
    if (fits && configured) {
        runtime = PyObject_GetAttr(hook_refs.runtime_module, s_current);
        if (runtime == NULL) {
            PyErr_Clear();
        }
    }
    if (runtime == NULL || runtime == Py_None) {  /* off, or a call we do not know: torch's own */
        Py_XDECREF(runtime);
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }
    if (self->kind == INVOKE_RPC) {
        PyObject *result = invoke_rpc_call(self, runtime, args, nargsf, kwnames);
        Py_DECREF(runtime);
        return result;
    }
    if (keep_thread_states && !thread_state_seen) {
        keep_thread_state();
    }
    if (self->kind == RUN_FUNCTION) {
        PyObject *result = keep_thread_states ? run_in_new_context(self, runtime, args, nargsf)
                                              : run_function_call(self, runtime, args, nargsf);
        Py_DECREF(runtime);
        return result;
    }
    double start = 0.0, end = 0.0;
    PyObject *where = self->kind == SERIALIZE ? hook_refs.where_serialize : hook_refs.where_deserialize;
    if (read_clock(&start) < 0 && swallow(where) < 0) {
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *out = PyObject_Vectorcall(self->original, args, nargsf, NULL);
    if (out == NULL) {  /* torch's error, raised as it is */
        Py_DECREF(runtime);
        return NULL;
    }
    if (read_clock(&end) < 0) {
        if (swallow(where) < 0) {
            Py_DECREF(out);
            Py_DECREF(runtime);
            return NULL;
        }
        Py_DECREF(runtime);
        return out;
    }
    PyObject *call_args[6];
    PyObject *start_obj = NULL, *seconds_obj = NULL;  /* made for the general paths only */
    PyObject *result = NULL;
    if (self->kind == SERIALIZE) {
        if (!PyTuple_CheckExact(out) || PyTuple_GET_SIZE(out) != 2) {  /* not (data, tensors): not ours to read */
            result = Py_NewRef(out);
            goto done;
        }
        call_args[0] = runtime, call_args[1] = args[1], call_args[2] = PyTuple_GET_ITEM(out, 0);
        call_args[3] = PyTuple_GET_ITEM(out, 1);
        result = serialized(runtime, args[1], call_args[2], call_args[3], start, end - start);
        if (result == refs.not_handled) {
            Py_DECREF(result);
            result = NULL;
            if ((call_args[4] = seconds_obj = PyFloat_FromDouble(end - start)) == NULL) {
                goto failed;
            }
            /* _serialize_other(runtime, obj, data, tensors, seconds) */
            result = PyObject_Vectorcall(hook_refs.serialize_other, call_args, 5, NULL);
        }
    }
    else {
        call_args[0] = runtime, call_args[1] = out, call_args[2] = args[1], call_args[3] = args[2];
        result = handle(runtime, out, args[1], args[2], start, end - start);
        if (result == refs.not_handled) {
            Py_DECREF(result);
            result = NULL;
            if ((call_args[4] = start_obj = PyFloat_FromDouble(start)) == NULL ||
                (call_args[5] = seconds_obj = PyFloat_FromDouble(end - start)) == NULL) {
                goto failed;
            }
            result = PyObject_Vectorcall(hook_refs.on_other_message, call_args, 6, NULL);
        }
    }
    if (result != NULL) {
        goto done;
    }
failed:
    if (swallow(where) < 0) {
        Py_CLEAR(out);
    }
    else {
        result = Py_NewRef(out);  /* what torch made, untouched */
    }
done:
    Py_XDECREF(out);
    Py_XDECREF(start_obj);
    Py_XDECREF(seconds_obj);
    Py_DECREF(runtime);
    return result;
}

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *original;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi:Hook", &original, &kind)) {
        return NULL;
    }
    if (kind != SERIALIZE && kind != DESERIALIZE && kind != RUN_FUNCTION && kind != INVOKE_RPC) {
        PyErr_SetString(PyExc_ValueError, "Hook kind: SERIALIZE, DESERIALIZE, RUN_FUNCTION or INVOKE_RPC");
        return NULL;
    }
    Hook *self = (Hook *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->original = Py_NewRef(original);
    self->kind = kind;
    self->vectorcall = hook_call;
    return (PyObject *)self;
}

static int
hook_traverse(Hook *self, visitproc visit, void *arg)
{
    Py_VISIT(self->original);
    Py_VISIT(self->dict);
    return 0;
}

static int
hook_clear(Hook *self)
{
    Py_CLEAR(self->original);
    Py_CLEAR(self->dict);
    return 0;
}

static void
hook_dealloc(Hook *self)
{
    PyObject_GC_UnTrack(self);
    hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A method on a class: bound to the instance, as a function would be. */
static PyObject *
hook_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static PyGetSetDef hook_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hook_members[] = {
    {"original", T_OBJECT, offsetof(Hook, original), READONLY, "the method it wraps"},
    {"kind", T_INT, offsetof(Hook, kind), READONLY, "SERIALIZE, DESERIALIZE, RUN_FUNCTION or INVOKE_RPC"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rpc_observe.hooks._core.Hook",
    .tp_doc = "Hook(original, kind): _InternalRPCPickler.serialize (kind 0) or deserialize (kind 1), wrapped\n"
              "(pickler.wrap_serialize / wrap_deserialize, in C).",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_descr_get = hook_get,
    .tp_dictoffset = offsetof(Hook, dict),
    .tp_getset = hook_getset,
    .tp_members = hook_members,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

PyDoc_STRVAR(configure_hooks_doc,
"configure_hooks(runtime_module, perf_counter, internal_error, on_other_message, serialize_other, /)\n--\n\n"
"Hands the Hook objects what they use besides `configure`'s (pickler.py calls it once, at import).");

static PyObject *
configure_hooks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "configure_hooks takes 5 arguments");
        return NULL;
    }
    PyObject **slots[] = {&hook_refs.runtime_module, &hook_refs.perf_counter, &hook_refs.internal_error,
                          &hook_refs.on_other_message, &hook_refs.serialize_other};
    int native = is_time_function(args[1], "perf_counter");
    if (native < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    native_perf_counter = native;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(configure_run_doc,
"configure_run(serving, proxies, site_of, end_other, fold_served, unknown, /)\n--\n\n"
"Hands the _run_function Hook server.py's tables and helpers (server.py calls it once, at import).");

static PyObject *
configure_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || args[0] != (PyObject *)&serving_table || !PyUnicode_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "configure_run(serving: _core.serving, proxies, site_of, end_other, fold_served, "
                                         "unknown: str)");
        return NULL;
    }
    PyObject **slots[] = {&hook_refs.serving, &hook_refs.proxies, &hook_refs.site_of, &hook_refs.end_other,
                          &hook_refs.fold_served, &hook_refs.unknown};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    Py_RETURN_NONE;
}

/* ---- The fold: Metrics.drain's queued records into their cells (telemetry/metrics.py, line by line) ----
 *
 * Each record starts with the Python fold function that takes it. A record of one of the five known folds, of the
 * shapes metrics.py unpacks, is folded here; anything else (another function, another shape, a cell that is not a
 * list of the bucket count's length) goes to that function itself, so the outcome, an exception included, is the
 * reference's. Every check comes before the first change to a cell. */

enum { SIZE, COUNT, LATENCY, SERIALIZATION, BUCKET_KINDS };
enum { MESSAGE_CELLS, CLIENT_CELLS, SERVER_CELLS, CELL_TYPES };

static struct {
    PyObject *folds[FOLDS];
    PyObject *cell_types[CELL_TYPES];  /* MessageCells, ClientCells, ServerCells: read by name in metrics.py */
    PyObject *buckets[BUCKET_KINDS];  /* the declared tuples, for comparisons a double cannot make exactly */
    double *bounds[BUCKET_KINDS];  /* the same as doubles */
    Py_ssize_t sizes[BUCKET_KINDS];
    PyObject *one, *zero, *zero_float;
} fold_refs;

static PyObject *s_sampled;

/* bisect.bisect_left(buckets, x), the same steps; x compared as a double when it is one exactly. */
static Py_ssize_t
bisect(int kind, PyObject *x)
{
    Py_ssize_t lo = 0, hi = fold_refs.sizes[kind];
    double value = 0.0;
    int exact = 0;
    if (PyFloat_CheckExact(x)) {
        value = PyFloat_AS_DOUBLE(x);
        exact = 1;
    }
    else if (PyLong_CheckExact(x)) {
        int overflow = 0;
        long long n = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (!overflow && n > -(1LL << 53) && n < (1LL << 53)) {
            value = (double)n;
            exact = 1;
        }
    }
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int less;
        if (exact) {
            less = fold_refs.bounds[kind][mid] < value;
        }
        else if ((less = PyObject_RichCompareBool(PyTuple_GET_ITEM(fold_refs.buckets[kind], mid), x, Py_LT)) < 0) {
            return -1;
        }
        if (less) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return lo;
}

/* cell[index] += value (or -=): a new object in the list, as Python's augmented assignment. */
static int
add_at(PyObject *cell, Py_ssize_t index, PyObject *value, int subtract)
{
    PyObject *item = PyList_GET_ITEM(cell, index);
    PyObject *sum = subtract ? PyNumber_InPlaceSubtract(item, value) : PyNumber_InPlaceAdd(item, value);
    if (sum == NULL) {
        return -1;
    }
    PyList_SetItem(cell, index, sum);  /* steals `sum`, releases the old item */
    return 0;
}

/* A histogram cell of `kind`: a list of the bucket counts (+Inf included) and the sum. */
static int
is_histogram(PyObject *cell, int kind)
{
    return PyList_CheckExact(cell) && PyList_GET_SIZE(cell) == fold_refs.sizes[kind] + 2;
}

/* `x if x > 0 else 0.0`: a duration clamped at 0, as client_python does (a new reference). */
static PyObject *
clamped(PyObject *x)
{
    int positive = PyObject_RichCompareBool(x, fold_refs.zero, Py_GT);
    return positive < 0 ? NULL : Py_NewRef(positive ? x : fold_refs.zero_float);
}

/* `cell[bisect(buckets, x)] += 1; cell[-1] += x` (x clamped at 0 if `clamp`), in that order; the bucket in
 * *bucket when it is asked for. */
static int
observe(PyObject *cell, int kind, PyObject *x, int clamp, Py_ssize_t *bucket)
{
    Py_ssize_t i = bisect(kind, x);
    if (i < 0 || add_at(cell, i, fold_refs.one, 0) < 0) {
        return -1;
    }
    PyObject *added = clamp ? clamped(x) : Py_NewRef(x);
    int failed = added == NULL || add_at(cell, PyList_GET_SIZE(cell) - 1, added, 0) < 0;
    Py_XDECREF(added);
    if (bucket != NULL) {
        *bucket = i;
    }
    return failed ? -1 : 0;
}

/* `if span is not None and span.sampled: exemplars[bucket] = (span, seconds)` */
static int
keep_exemplar(PyObject *exemplars, Py_ssize_t bucket, PyObject *span, PyObject *seconds)
{
    if (span == Py_None) {
        return 0;
    }
    PyObject *sampled = GET(span, s_sampled);
    int yes = sampled == NULL ? -1 : PyObject_IsTrue(sampled);
    Py_XDECREF(sampled);
    if (yes <= 0) {
        return yes;
    }
    PyObject *pair = PyTuple_Pack(2, span, seconds);
    return pair == NULL ? -1 : PyList_SetItem(exemplars, bucket, pair);
}

/* A latency histogram and its exemplar slots (ClientCells.duration/.exemplars, ServerCells's). */
static int
is_timed(PyObject *cell, PyObject *exemplars)
{
    return is_histogram(cell, LATENCY) && PyList_CheckExact(exemplars) &&
           PyList_GET_SIZE(exemplars) == fold_refs.sizes[LATENCY] + 1;
}

static int
is_counter(PyObject *cell)
{
    return PyList_CheckExact(cell) && PyList_GET_SIZE(cell) >= 1;
}

#define ITEM(tuple, i) PyTuple_GET_ITEM((tuple), (i))

/* 1 folded, 0 not a record this code knows (the caller runs its function), -1 an error. */
static int
fold_known(PyObject *r)
{
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) < 2) {
        return 0;
    }
    PyObject *fold = ITEM(r, 0), *cells = ITEM(r, 1);
    Py_ssize_t n = PyTuple_GET_SIZE(r);
    PyObject *cells_type = (PyObject *)Py_TYPE(cells);
    if (!PyTuple_Check(cells)) {
        return 0;
    }
    Py_ssize_t ncells = PyTuple_GET_SIZE(cells);
    if (fold == fold_refs.folds[FOLD_MESSAGE]) {
        /* (fold, MessageCells, payload bytes, tensors, tensor bytes, storage bytes, seconds, peer cell, wire) */
        if (n != 9 || cells_type != fold_refs.cell_types[MESSAGE_CELLS] || ncells != 5 || !is_histogram(ITEM(cells, 0), SIZE) || !is_histogram(ITEM(cells, 1), COUNT) ||
            !is_histogram(ITEM(cells, 2), SIZE) || !is_histogram(ITEM(cells, 3), SIZE) ||
            !is_histogram(ITEM(cells, 4), SERIALIZATION) || !(ITEM(r, 7) == Py_None || is_counter(ITEM(r, 7)))) {
            return 0;
        }
        if (ITEM(r, 7) != Py_None && add_at(ITEM(r, 7), 0, ITEM(r, 8), 0) < 0) {
            return -1;
        }
        static const int kinds[4] = {SIZE, COUNT, SIZE, SIZE};
        for (int i = 0; i < 4; i++) {
            if (observe(ITEM(cells, i), kinds[i], ITEM(r, 2 + i), 0, NULL) < 0) {
                return -1;
            }
        }
        return observe(ITEM(cells, 4), SERIALIZATION, ITEM(r, 6), 1, NULL) < 0 ? -1 : 1;
    }
    if (fold == fold_refs.folds[FOLD_STARTED]) {  /* (fold, ClientCells) */
        if (n != 2 || cells_type != fold_refs.cell_types[CLIENT_CELLS] || ncells != 8 || !is_counter(ITEM(cells, 1)) || !is_counter(ITEM(cells, 2))) {
            return 0;
        }
        return add_at(ITEM(cells, 1), 0, fold_refs.one, 0) < 0 || add_at(ITEM(cells, 2), 0, fold_refs.one, 0) < 0
               ? -1 : 1;
    }
    if (fold == fold_refs.folds[FOLD_FINISHED] || fold == fold_refs.folds[FOLD_SPLIT]) {
        /* (fold, ClientCells, seconds, span) or (fold, ClientCells, seconds, callee seconds, span) */
        int split = fold == fold_refs.folds[FOLD_SPLIT];
        if (n != (split ? 5 : 4) || cells_type != fold_refs.cell_types[CLIENT_CELLS] || ncells != 8 || !is_timed(ITEM(cells, 0), ITEM(cells, 7)) ||
            !is_counter(ITEM(cells, 2)) ||
            (split && (!is_histogram(ITEM(cells, 5), LATENCY) || !is_histogram(ITEM(cells, 6), LATENCY)))) {
            return 0;
        }
        PyObject *seconds = ITEM(r, 2), *span = ITEM(r, n - 1);
        Py_ssize_t bucket = 0;
        int failed = observe(ITEM(cells, 0), LATENCY, seconds, 1, &bucket) < 0 ||
                     add_at(ITEM(cells, 2), 0, fold_refs.one, 1) < 0 ||
                     keep_exemplar(ITEM(cells, 7), bucket, span, seconds) < 0;
        if (failed || !split) {
            return failed ? -1 : 1;
        }
        PyObject *callee = ITEM(r, 3);
        if (observe(ITEM(cells, 5), LATENCY, callee, 0, NULL) < 0) {
            return -1;
        }
        /* outside = seconds - callee if seconds > callee else 0.0 */
        int longer = PyObject_RichCompareBool(seconds, callee, Py_GT);
        PyObject *outside = longer < 0 ? NULL : longer ? PyNumber_Subtract(seconds, callee)
                                                       : Py_NewRef(fold_refs.zero_float);
        failed = outside == NULL || observe(ITEM(cells, 6), LATENCY, outside, 0, NULL) < 0;
        Py_XDECREF(outside);
        return failed ? -1 : 1;
    }
    if (fold == fold_refs.folds[FOLD_SERVED]) {  /* (fold, ServerCells, seconds, span) */
        if (n != 4 || cells_type != fold_refs.cell_types[SERVER_CELLS] || ncells != 2 || !is_timed(ITEM(cells, 0), ITEM(cells, 1))) {
            return 0;
        }
        PyObject *seconds = ITEM(r, 2);
        Py_ssize_t bucket = 0;
        return observe(ITEM(cells, 0), LATENCY, seconds, 1, &bucket) < 0 ||
               keep_exemplar(ITEM(cells, 1), bucket, ITEM(r, 3), seconds) < 0 ? -1 : 1;
    }
    return 0;
}

/* ---- Records: the metrics' queue of records where the core is built (Metrics.use_queue) ----
 *
 * A deque's append, popleft, clear, len and iteration, over a ring of `crecord`s: the hot paths above push their
 * records as they are, and a record becomes the tuple metrics.py declares only when it is taken (popleft, for the
 * fold; iteration, for tests), made by `as_tuple`, the one place that knows the shapes. Every access holds the GIL,
 * and an entry leaves the ring before anything that could run Python code (and so let another thread in) is
 * done with it. */

typedef struct {
    PyObject_HEAD
    crecord *ring;
    Py_ssize_t head, size, capacity;  /* capacity: 0 or a power of 2 */
} Records;

static PyTypeObject RecordsType;

/* The record as metrics.py's tuple (a new reference); a record appended as an object is itself. */
static PyObject *
as_tuple(const crecord *r)
{
    PyObject *fold = r->fold >= 0 ? fold_refs.folds[r->fold] : NULL;
    switch (r->fold) {
    case FOLD_MESSAGE:
        return Py_BuildValue("(OOLLLLdOL)", fold, r->cells, r->n[N_PAYLOAD], r->n[N_TENSORS], r->n[N_LOGICAL],
                             r->n[N_TRAVELING], r->s[0], r->other, r->n[N_WIRE]);
    case FOLD_FINISHED:
    case FOLD_SERVED:
        return Py_BuildValue("(OOdO)", fold, r->cells, r->s[0], r->other);
    case FOLD_SPLIT:
        return Py_BuildValue("(OOddO)", fold, r->cells, r->s[0], r->s[1], r->other);
    default:
        return Py_NewRef(r->cells);
    }
}

static void
crecord_clear(crecord *r)
{
    Py_CLEAR(r->cells);
    Py_CLEAR(r->other);
}

/* Takes a copy of `r` (its references added) at the end of the ring. */
static int
records_push(Records *q, const crecord *r)
{
    if (q->size == q->capacity) {
        Py_ssize_t capacity = q->capacity ? q->capacity * 2 : 64;
        if (capacity > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(crecord)) {
            PyErr_NoMemory();
            return -1;
        }
        crecord *ring = PyMem_Malloc((size_t)capacity * sizeof(crecord));
        if (ring == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < q->size; i++) {  /* in order, from the head */
            ring[i] = q->ring[(q->head + i) & (q->capacity - 1)];
        }
        PyMem_Free(q->ring);
        q->ring = ring, q->head = 0, q->capacity = capacity;
    }
    crecord *slot = &q->ring[(q->head + q->size) & (q->capacity - 1)];
    *slot = *r;
    Py_INCREF(slot->cells);
    Py_XINCREF(slot->other);
    q->size++;
    return 0;
}

static int
push_record(PyObject *record, crecord *r)
{
    if (fold_refs.one != NULL && PyCFunction_Check(record)) {  /* Records.append, bound: the queue itself */
        PyObject *queue = PyCFunction_GET_SELF(record);
        if (queue != NULL && Py_IS_TYPE(queue, &RecordsType)) {
            return records_push((Records *)queue, r);
        }
    }
    PyObject *tuple = as_tuple(r);
    PyObject *done = tuple != NULL ? PyObject_CallOneArg(record, tuple) : NULL;
    Py_XDECREF(tuple);
    Py_XDECREF(done);
    return done != NULL ? 0 : -1;
}

static PyObject *
records_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Records() takes no arguments");
        return NULL;
    }
    if (fold_refs.one == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_core.configure_fold was not called");
        return NULL;
    }
    return type->tp_alloc(type, 0);  /* zeroed: empty, no ring yet */
}

/* Releases every record, one at a time: a release may run Python code that appends. */
static int
records_drop(Records *q)
{
    while (q->size > 0) {
        crecord r = q->ring[q->head];
        q->head = (q->head + 1) & (q->capacity - 1), q->size--;
        crecord_clear(&r);
    }
    return 0;
}

static PyObject *
records_clear(Records *q, PyObject *unused)
{
    records_drop(q);
    Py_RETURN_NONE;
}

static void
records_dealloc(Records *q)
{
    PyObject_GC_UnTrack(q);
    records_drop(q);
    PyMem_Free(q->ring);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static int
records_traverse(Records *q, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < q->size; i++) {
        crecord *r = &q->ring[(q->head + i) & (q->capacity - 1)];
        Py_VISIT(r->cells);
        Py_VISIT(r->other);
    }
    return 0;
}

static PyObject *
records_append(Records *q, PyObject *record)
{
    crecord r = {-1, record, NULL, {0}, {0.0, 0.0}};
    return records_push(q, &r) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *
records_popleft(Records *q, PyObject *unused)
{
    if (q->size == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty Records");
        return NULL;
    }
    crecord r = q->ring[q->head];
    q->head = (q->head + 1) & (q->capacity - 1), q->size--;
    PyObject *tuple = as_tuple(&r);
    crecord_clear(&r);
    return tuple;
}

static Py_ssize_t
records_len(Records *q)
{
    return q->size;
}

static PyObject *
records_iter(Records *q)
{
    PyObject *list = PyList_New(0);  /* a snapshot, as tuples */
    for (Py_ssize_t i = 0; list != NULL && i < q->size; i++) {
        PyObject *tuple = as_tuple(&q->ring[(q->head + i) & (q->capacity - 1)]);
        if (tuple == NULL || PyList_Append(list, tuple) < 0) {
            Py_CLEAR(list);
        }
        Py_XDECREF(tuple);
    }
    PyObject *iter = list != NULL ? PyObject_GetIter(list) : NULL;
    Py_XDECREF(list);
    return iter;
}

static PyMethodDef records_methods[] = {
    {"append", (PyCFunction)records_append, METH_O, "Queues a record (a tuple of metrics.py's shapes)."},
    {"popleft", (PyCFunction)records_popleft, METH_NOARGS, "The oldest record, as metrics.py's tuple, taken out."},
    {"clear", (PyCFunction)records_clear, METH_NOARGS, "Drops every record."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods records_as_sequence = {.sq_length = (lenfunc)records_len};

static PyTypeObject RecordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rpc_observe.hooks._core.Records",
    .tp_doc = "Records(): the metrics' record queue, as a deque of tuples to Python; the C hot paths push records\n"
              "without making them (Metrics.use_queue).",
    .tp_basicsize = sizeof(Records),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = records_new,
    .tp_dealloc = (destructor)records_dealloc,
    .tp_traverse = (traverseproc)records_traverse,
    .tp_clear = (inquiry)records_drop,
    .tp_iter = (getiterfunc)records_iter,
    .tp_as_sequence = &records_as_sequence,
    .tp_methods = records_methods,
};

PyDoc_STRVAR(fold_doc,
"fold(records, n, /)\n--\n\n"
"metrics.fold_records: pops `n` records off the left of the deque `records` and folds each into its cells.");

static PyObject *
fold(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fold(records, n)");
        return NULL;
    }
    if (fold_refs.one == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_core.configure_fold was not called");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *popleft = PyObject_GetAttrString(args[0], "popleft");
    if (popleft == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyObject_CallNoArgs(popleft);
        if (record == NULL) {
            Py_DECREF(popleft);
            return NULL;
        }
        int done = fold_known(record);
        if (done == 0) {  /* record[0](record) */
            PyObject *function = PySequence_GetItem(record, 0);
            PyObject *result = function != NULL ? PyObject_CallOneArg(function, record) : NULL;
            Py_XDECREF(function);
            Py_XDECREF(result);
            done = result != NULL ? 1 : -1;
        }
        Py_DECREF(record);
        if (done < 0) {
            Py_DECREF(popleft);
            return NULL;
        }
    }
    Py_DECREF(popleft);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(configure_fold_doc,
"configure_fold(fold_message, fold_started, fold_finished, fold_split, fold_served,\n"
"               size_buckets, count_buckets, latency_buckets, serialization_buckets,\n"
"               message_cells, client_cells, server_cells, /)\n--\n\n"
"Hands `fold` metrics.py's fold functions, the declared buckets (increasing floats) and the cell tuples' types.");

static PyObject *
configure_fold(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != FOLDS + BUCKET_KINDS + CELL_TYPES) {
        PyErr_SetString(PyExc_TypeError, "configure_fold takes 12 arguments");
        return NULL;
    }
    for (int c = 0; c < CELL_TYPES; c++) {
        if (!PyType_Check(args[FOLDS + BUCKET_KINDS + c])) {
            PyErr_SetString(PyExc_TypeError, "configure_fold: the cells' types must be types");
            return NULL;
        }
    }
    double *bounds[BUCKET_KINDS] = {NULL};
    for (int k = 0; k < BUCKET_KINDS; k++) {
        PyObject *buckets = args[FOLDS + k];
        Py_ssize_t size = PyTuple_Check(buckets) ? PyTuple_GET_SIZE(buckets) : -1;
        if (size < 0 || (bounds[k] = PyMem_Calloc((size_t)size + 1, sizeof(double))) == NULL) {
            if (size < 0) {
                PyErr_SetString(PyExc_TypeError, "configure_fold: the buckets must be tuples of floats");
            }
            else {
                PyErr_NoMemory();
            }
            goto failed;
        }
        for (Py_ssize_t i = 0; i < size; i++) {
            PyObject *bound = PyTuple_GET_ITEM(buckets, i);
            if (!PyFloat_CheckExact(bound) || (i > 0 && !(bounds[k][i - 1] < PyFloat_AS_DOUBLE(bound)))) {
                PyErr_SetString(PyExc_TypeError, "configure_fold: the buckets must be increasing floats");
                goto failed;
            }
            bounds[k][i] = PyFloat_AS_DOUBLE(bound);
        }
    }
    if ((fold_refs.one == NULL && (fold_refs.one = PyLong_FromLong(1)) == NULL) ||
        (fold_refs.zero == NULL && (fold_refs.zero = PyLong_FromLong(0)) == NULL) ||
        (fold_refs.zero_float == NULL && (fold_refs.zero_float = PyFloat_FromDouble(0.0)) == NULL) ||
        (s_sampled == NULL && (s_sampled = PyUnicode_InternFromString("sampled")) == NULL)) {
        goto failed;
    }
    for (int f = 0; f < FOLDS; f++) {
        Py_XSETREF(fold_refs.folds[f], Py_NewRef(args[f]));
    }
    for (int c = 0; c < CELL_TYPES; c++) {
        Py_XSETREF(fold_refs.cell_types[c], Py_NewRef(args[FOLDS + BUCKET_KINDS + c]));
    }
    for (int k = 0; k < BUCKET_KINDS; k++) {
        Py_XSETREF(fold_refs.buckets[k], Py_NewRef(args[FOLDS + k]));
        PyMem_Free(fold_refs.bounds[k]);
        fold_refs.bounds[k] = bounds[k];
        fold_refs.sizes[k] = PyTuple_GET_SIZE(args[FOLDS + k]);
    }
    Py_RETURN_NONE;
failed:
    for (int k = 0; k < BUCKET_KINDS; k++) {
        PyMem_Free(bounds[k]);
    }
    return NULL;
}

static PyMethodDef core_methods[] = {
    {"parse", parse, METH_O, parse_doc},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, configure_doc},
    {"configure_hooks", (PyCFunction)(void (*)(void))configure_hooks, METH_FASTCALL, configure_hooks_doc},
    {"configure_run", (PyCFunction)(void (*)(void))configure_run, METH_FASTCALL, configure_run_doc},
    {"configure_invoke", (PyCFunction)(void (*)(void))configure_invoke, METH_FASTCALL, configure_invoke_doc},
    {"keep_thread_states", (PyCFunction)set_keep_thread_states, METH_O, keep_thread_states_doc},
    {"new_call", (PyCFunction)(void (*)(void))new_call, METH_FASTCALL, new_call_doc},
    {"current_call", current_call, METH_NOARGS, current_call_doc},
    {"set_current_call", set_current_call, METH_O, set_current_call_doc},
    {"set_pending_reply", (PyCFunction)(void (*)(void))set_pending_reply, METH_FASTCALL, set_pending_reply_doc},
    {"take_pending_reply", take_pending_reply, METH_NOARGS, take_pending_reply_doc},
    {"serving_slots", serving_slots_count, METH_NOARGS, serving_slots_doc},
    {"random_id", random_id_function, METH_O, random_id_doc},
    {"tracer_settings_changed", tracer_settings_changed, METH_NOARGS, tracer_settings_changed_doc},
    {"slot_attr", (PyCFunction)(void (*)(void))slot_attr, METH_FASTCALL, slot_attr_doc},
    {"slot_misses", slot_misses_count, METH_NOARGS, slot_misses_doc},
    {"configure_fold", (PyCFunction)(void (*)(void))configure_fold, METH_FASTCALL, configure_fold_doc},
    {"configure_spans", (PyCFunction)(void (*)(void))configure_spans, METH_FASTCALL, configure_spans_doc},
    {"parse_traceparent", parse_traceparent, METH_O, parse_traceparent_doc},
    {"fold", (PyCFunction)(void (*)(void))fold, METH_FASTCALL, fold_doc},
    {"take_incoming", take_incoming, METH_NOARGS, take_incoming_doc},
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
    if (intern_names() < 0 ||
        (s_current == NULL && (s_current = PyUnicode_InternFromString("current")) == NULL) ||
        (hook_refs.where_serialize == NULL &&
         (hook_refs.where_serialize = PyUnicode_InternFromString("serialize")) == NULL) ||
        (hook_refs.where_deserialize == NULL &&
         (hook_refs.where_deserialize = PyUnicode_InternFromString("deserialize")) == NULL) ||
        intern_run_names() < 0 || intern_invoke_names() < 0 || PyType_Ready(&HookType) < 0 ||
        PyType_Ready(&RecordsType) < 0 || PyType_Ready(&CallBaseType) < 0 ||
        PyType_Ready(&FinishedCallsType) < 0 || PyType_Ready(&ServingTableType) < 0) {
        return NULL;
    }
    static int fork_handler;
    if (!fork_handler && pthread_atfork(NULL, NULL, ids_after_fork) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return NULL;
    }
    fork_handler = 1;
    PyObject *module = PyModule_Create(&core_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Hook", (PyObject *)&HookType) < 0 ||
        PyModule_AddObjectRef(module, "Records", (PyObject *)&RecordsType) < 0 ||
        PyModule_AddObjectRef(module, "CallBase", (PyObject *)&CallBaseType) < 0 ||
        PyModule_AddObjectRef(module, "FinishedCalls", (PyObject *)&FinishedCallsType) < 0 ||
        PyModule_AddObjectRef(module, "serving", (PyObject *)&serving_table) < 0 ||
        PyModule_AddObjectRef(module, "serving_spans", (PyObject *)&serving_spans) < 0 ||
        PyModule_AddIntConstant(module, "SERIALIZE", SERIALIZE) < 0 ||
        PyModule_AddIntConstant(module, "DESERIALIZE", DESERIALIZE) < 0 ||
        PyModule_AddIntConstant(module, "RUN_FUNCTION", RUN_FUNCTION) < 0 ||
        PyModule_AddIntConstant(module, "INVOKE_RPC", INVOKE_RPC) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
