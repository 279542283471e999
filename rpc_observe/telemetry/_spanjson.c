/* rpc_observe.telemetry._spanjson: the file exporter's batch encoding in C (exporters.OtlpJsonFileSink._lines).
 *
 * A batch of SpanRecords becomes OTLP/HTTP JSON lines of at most `budget` bytes of spans each. The C code
 * formats the common span (no error, ids and times that are plain ints in range) with the exporter's own
 * templates, handed over at configure() time, so the text of a span is defined once, in exporters.py; every
 * other span is formatted by the Python method it is given (`span_json`), and a call site's shared text
 * (name, kind, attributes) comes from the Python method `site_text`, once per site a batch. The Python
 * `_lines` stays the reference (tests/unit/test_spanjson.py compares the two on the same records). Built when
 * a C compiler is there (hatch_build.py); RPC_OBSERVE_NO_EXTENSIONS=1 or no compiler: the Python code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "../_ids.h"

/* The SpanRecord slots read here, by name (configure() finds their offsets). */
enum { S_NAME, S_KIND, S_TRACE, S_SPAN, S_PARENT, S_START, S_END, S_ATTRS, S_ERROR, N_SLOTS };
static const char *slot_names[N_SLOTS] = {"name", "kind", "trace_id", "span_id", "parent_id", "start_ns", "end_ns",
                                          "attributes", "error_type"};
static Py_ssize_t slot_offset[N_SLOTS];
static PyTypeObject *span_type;  /* a strong reference, set by configure() */

/* A template's literal pieces: a root span has 5 values between 6 pieces (trace, span, start, end, site), a
 * child span 6 between 7 (trace, span, parent, start, end, site). */
#define MAX_PIECES 7
typedef struct {
    int count;
    PyObject *owner;  /* the tuple of bytes the pieces point into */
    const char *text[MAX_PIECES];
    Py_ssize_t len[MAX_PIECES];
} Template;
static Template root_span, child_span;

#define SLOT(obj, s) (*(PyObject **)((char *)(obj) + slot_offset[s]))

typedef struct { char *p; Py_ssize_t len, cap; } Buf;

static int
buf_reserve(Buf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap) {
        return 0;
    }
    Py_ssize_t cap = b->cap ? b->cap : 1 << 12;
    while (cap < b->len + more) {
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p, b->cap = cap;
    return 0;
}

static int
buf_put(Buf *b, const char *s, Py_ssize_t n)
{
    if (buf_reserve(b, n) < 0) {
        return -1;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

/* An exact int that fits a long long, as decimal text: its length; 0: the Python path formats it. */
static int
int_text(PyObject *v, char *out)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    char tmp[24];
    int i = 24, negative = value < 0;
    unsigned long long u = negative ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        tmp[--i] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (negative) {
        tmp[--i] = '-';
    }
    memcpy(out, tmp + i, 24 - i);
    return 24 - i;
}

/* What spans of one call site share, looked up by the identity of (attributes, name, kind) within a batch. */
#define SITES 16
typedef struct {
    PyObject *attributes, *name, *kind, *text;  /* strong: an identity stays the same object's */
} Site;

/* The site text of record `r` as UTF-8, from the batch's table or site_text(r); NULL with no error: a new site
 * when the table is full (the Python path formats that span). */
static const char *
site_utf8(PyObject *r, PyObject *site_text, Site *sites, int *site_count, Py_ssize_t *size)
{
    PyObject *attributes = SLOT(r, S_ATTRS), *name = SLOT(r, S_NAME), *kind = SLOT(r, S_KIND);
    for (int i = 0; i < *site_count; i++) {
        if (sites[i].attributes == attributes && sites[i].name == name && sites[i].kind == kind) {
            return PyUnicode_AsUTF8AndSize(sites[i].text, size);
        }
    }
    if (*site_count == SITES) {
        return NULL;
    }
    PyObject *text = PyObject_CallOneArg(site_text, r);
    if (text == NULL) {
        return NULL;
    }
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "site_text must return a str");
        Py_DECREF(text);
        return NULL;
    }
    sites[(*site_count)++] = (Site){Py_NewRef(attributes), Py_NewRef(name), Py_NewRef(kind), text};
    return PyUnicode_AsUTF8AndSize(text, size);
}

/* One common span's JSON into `out`: 1 done, 0 not a common span (nothing written), -1 an error. */
static int
format_span(Buf *out, PyObject *r, PyObject *site_text, Site *sites, int *site_count)
{
    if (Py_TYPE(r) != span_type) {
        return 0;
    }
    for (int i = 0; i < N_SLOTS; i++) {
        if (SLOT(r, i) == NULL) {  /* a slot never set (a record made without __init__): Python raises */
            return 0;
        }
    }
    if (SLOT(r, S_ERROR) != Py_None) {
        return 0;
    }
    PyObject *parent = SLOT(r, S_PARENT);
    if (parent != Py_None && !PyLong_CheckExact(parent)) {
        return 0;
    }
    int child = parent != Py_None && PyObject_IsTrue(parent);  /* exporters.py: `if r.parent_id:` */
    char trace[32], span[16], parent_hex[16], start[24], end[24];
    int start_len, end_len;
    if (!id_hex(SLOT(r, S_TRACE), trace, 16) || !id_hex(SLOT(r, S_SPAN), span, 8) ||
        (child && !id_hex(parent, parent_hex, 8)) || !(start_len = int_text(SLOT(r, S_START), start)) ||
        !(end_len = int_text(SLOT(r, S_END), end))) {
        return 0;
    }
    Py_ssize_t site_len;
    const char *site = site_utf8(r, site_text, sites, site_count, &site_len);
    if (site == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    const Template *t = child ? &child_span : &root_span;
    Py_ssize_t size = site_len + 32 + 16 + (child ? 16 : 0) + start_len + end_len;
    for (int i = 0; i < t->count; i++) {
        size += t->len[i];
    }
    if (buf_reserve(out, size) < 0) {
        return -1;
    }
    char *p = out->p + out->len;
    int piece = 0;
#define PIECE() (memcpy(p, t->text[piece], t->len[piece]), p += t->len[piece], piece++)
    PIECE();
    memcpy(p, trace, 32), p += 32;
    PIECE();
    memcpy(p, span, 16), p += 16;
    PIECE();
    if (child) {
        memcpy(p, parent_hex, 16), p += 16;
        PIECE();
    }
    memcpy(p, start, start_len), p += start_len;
    PIECE();
    memcpy(p, end, end_len), p += end_len;
    PIECE();
    memcpy(p, site, site_len), p += site_len;
    PIECE();
#undef PIECE
    out->len = p - out->p;
    return 1;
}

/* Appends (head + spans + tail, count) to `lines`. */
static int
emit_line(PyObject *lines, PyObject *head, const Buf *spans, PyObject *tail, Py_ssize_t count)
{
    Py_ssize_t head_len = PyBytes_GET_SIZE(head), tail_len = PyBytes_GET_SIZE(tail);
    PyObject *line = PyBytes_FromStringAndSize(NULL, head_len + spans->len + tail_len);
    if (line == NULL) {
        return -1;
    }
    char *p = PyBytes_AS_STRING(line);
    memcpy(p, PyBytes_AS_STRING(head), head_len);
    memcpy(p + head_len, spans->p, spans->len);
    memcpy(p + head_len + spans->len, PyBytes_AS_STRING(tail), tail_len);
    PyObject *pair = Py_BuildValue("(Nn)", line, count);
    int failed = pair == NULL || PyList_Append(lines, pair) < 0;
    Py_XDECREF(pair);
    return failed ? -1 : 0;
}

PyDoc_STRVAR(lines_doc,
"lines(records, span_json, site_text, head, tail, budget, /)\n--\n\n"
"exporters.OtlpJsonFileSink._lines in C: the batch as (line, spans) pairs, each line's spans at most `budget`\n"
"bytes unless one span alone is bigger. span_json(record) -> str formats what the C code does not;\n"
"site_text(record) -> str is a call site's shared text.");

static PyObject *
lines(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyBytes_Check(args[3]) || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "lines(records, span_json, site_text, head: bytes, tail: bytes, budget)");
        return NULL;
    }
    if (span_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "lines: configure() first");
        return NULL;
    }
    PyObject *span_json = args[1], *site_text = args[2], *head = args[3], *tail = args[4];
    Py_ssize_t budget = PyLong_AsSsize_t(args[5]);
    if (budget == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *records = PySequence_Fast(args[0], "lines: records must be a sequence");
    if (records == NULL) {
        return NULL;
    }
    PyObject *result = PyList_New(0);
    Buf spans = {0}, one = {0};
    Site sites[SITES];
    int site_count = 0;
    Py_ssize_t count = 0;
    if (result == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(records); i++) {
        /* held: the callbacks are Python code, which could take it out of a list it is only borrowed from */
        PyObject *r = Py_NewRef(PySequence_Fast_GET_ITEM(records, i));
        one.len = 0;
        int done = format_span(&one, r, site_text, sites, &site_count);
        PyObject *text = done == 0 ? PyObject_CallOneArg(span_json, r) : NULL;
        Py_DECREF(r);
        if (done < 0) {
            goto error;
        }
        if (!done) {
            if (text == NULL) {
                goto error;
            }
            Py_ssize_t size;
            const char *utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &size) : NULL;
            if (utf8 == NULL && !PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "span_json must return a str");
            }
            int failed = utf8 == NULL || buf_put(&one, utf8, size) < 0;
            Py_DECREF(text);
            if (failed) {
                goto error;
            }
        }
        if (count > 0 && spans.len + 1 + one.len > budget) {
            if (emit_line(result, head, &spans, tail, count) < 0) {
                goto error;
            }
            spans.len = 0, count = 0;
        }
        if ((count > 0 && buf_put(&spans, ",", 1) < 0) || buf_put(&spans, one.p, one.len) < 0) {
            goto error;
        }
        count++;
    }
    if (count > 0 && emit_line(result, head, &spans, tail, count) < 0) {
        goto error;
    }
    goto done;
error:
    Py_CLEAR(result);
done:
    for (int i = 0; i < site_count; i++) {
        Py_DECREF(sites[i].attributes);
        Py_DECREF(sites[i].name);
        Py_DECREF(sites[i].kind);
        Py_DECREF(sites[i].text);
    }
    PyMem_Free(spans.p);
    PyMem_Free(one.p);
    Py_DECREF(records);
    return result;
}

/* A template's pieces from a tuple of bytes. */
static int
read_template(PyObject *pieces, int count, Template *t)
{
    if (!PyTuple_Check(pieces) || PyTuple_GET_SIZE(pieces) != count) {
        PyErr_Format(PyExc_ValueError, "configure: a template must be a tuple of %d bytes", count);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        PyObject *piece = PyTuple_GET_ITEM(pieces, i);
        if (!PyBytes_Check(piece)) {
            PyErr_Format(PyExc_ValueError, "configure: a template must be a tuple of %d bytes", count);
            return -1;
        }
        t->text[i] = PyBytes_AS_STRING(piece), t->len[i] = PyBytes_GET_SIZE(piece);
    }
    t->count = count;
    Py_XSETREF(t->owner, Py_NewRef(pieces));
    return 0;
}

PyDoc_STRVAR(configure_doc,
"configure(span_type, root_pieces, child_pieces, /)\n--\n\n"
"Hands over tracing.SpanRecord and the exporter's span templates cut at their values: a root span's 6 pieces\n"
"around (trace id, span id, start, end, site text), a child's 7 around (trace id, span id, parent id, start,\n"
"end, site text), each bytes.");

static PyObject *
configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "configure(span_type, root_pieces, child_pieces)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    Py_ssize_t found[N_SLOTS];
    int seen = 0;
    for (PyMemberDef *m = type->tp_members; m != NULL && m->name != NULL; m++) {
        for (int i = 0; i < N_SLOTS; i++) {
            if (strcmp(m->name, slot_names[i]) == 0) {
                if (m->type != T_OBJECT_EX) {
                    break;
                }
                found[i] = m->offset;
                seen |= 1 << i;
            }
        }
    }
    if (seen != (1 << N_SLOTS) - 1) {
        PyErr_SetString(PyExc_ValueError, "configure: span_type must be a class with SpanRecord's __slots__");
        return NULL;
    }
    if (read_template(args[1], 6, &root_span) < 0 || read_template(args[2], 7, &child_span) < 0) {
        return NULL;
    }
    memcpy(slot_offset, found, sizeof(found));
    Py_XSETREF(span_type, (PyTypeObject *)Py_NewRef(args[0]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, configure_doc},
    {"lines", (PyCFunction)(void (*)(void))lines, METH_FASTCALL, lines_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_spanjson",
                                        "The file exporter's batch encoding in C (exporters.py).", -1, methods};

PyMODINIT_FUNC
PyInit__spanjson(void)
{
    return PyModule_Create(&module_def);
}
