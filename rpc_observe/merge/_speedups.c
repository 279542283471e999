/* rpc_observe.merge._speedups: the two per-span loops of `rpc-observe merge` in C.
 *
 *   line_spans   reads the spans of one span-file line in the exporter's own layout
 *                (spanfile.SpanReader._piece_span, piece by piece);
 *   encode_spans encodes a lane group's slices, markers and flow ends
 *                (encode._slices).
 *
 * Both do only the common case and hand every other span back to the Python code,
 * which stays the reference (tests/unit/test_merge_speedups.py compares the two):
 * the formats come from Python at configure_events() time, so the text of each event is
 * defined once, in encode.py.  Built when a C compiler is there (hatch_build.py);
 * without it, or with RPC_OBSERVE_MERGE_SPEEDUPS=0, the merge runs in pure Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <string.h>

/* ---- configuration, set once at import (speedups.py, encode.py) ------------ */

enum { F_TRACE, F_SPAN, F_PARENT, F_NAME, F_KIND, F_START, F_END, F_WORKER, F_ATTRS,
       F_STATUS, F_MESSAGE, F_EVENTS, F_TID, F_PAIR, N_FIELDS };

typedef struct {
    Py_ssize_t n;          /* literal fragments: n, values between them: n - 1 */
    const char **text;
    Py_ssize_t *len;
} Template;

static PyTypeObject *span_type;
static Py_ssize_t field_offset[N_FIELDS];
static PyObject *field_default[N_FIELDS]; /* a fresh Span's values past the first nine */
static PyObject *config_refs;              /* keeps every configured object alive */
static long kind_client;
static long long marker_ns, long_ns;
static char frac_text[1000][5];
static unsigned char frac_len[1000];
static Template t_slice, t_slice_child, t_mark, t_long_client, t_long_server;
static Template t_flow_first_client, t_flow_last_client, t_flow_first_server, t_flow_last_server;
static PyObject *mark_name[4]; /* first and last marker: client, then server */
static int configured;

#define FIELD(obj, f) (*(PyObject **)((char *)(obj) + field_offset[f]))

/* ---- a growable ASCII buffer ---------------------------------------------------- */

typedef struct { char *p; Py_ssize_t len, cap; } Buf;

static int buf_grow(Buf *b, Py_ssize_t more) {
    Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + more) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p; b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_grow(b, n) < 0) return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

static inline int buf_int(Buf *b, long long v) {
    char tmp[24];
    int i = 24, neg = v < 0;
    unsigned long long u = neg ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do { tmp[--i] = (char)('0' + u % 10); u /= 10; } while (u);
    if (neg) tmp[--i] = '-';
    return buf_put(b, tmp + i, 24 - i);
}

/* An ASCII str's text (callers check PyUnicode_IS_COMPACT_ASCII first). */
static inline int buf_str(Buf *b, PyObject *s) {
    return buf_put(b, (const char *)PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s));
}

static inline int is_ascii_str(PyObject *s) {
    return s && PyUnicode_CheckExact(s) && PyUnicode_IS_COMPACT_ASCII(s);
}

/* ---- configure_span(), configure_events() ------------------------------------------ */

/* Holds a configured object for good (the module's tables point into it). */
static PyObject *keep(PyObject *o) {
    if (!config_refs && !(config_refs = PyList_New(0))) return NULL;
    return PyList_Append(config_refs, o) < 0 ? NULL : o;
}

/* A %-format with only %s and %d (and no %%), as its literal pieces; emit() writes each
 * value by its own type, whatever the letter. */
static int template_of(PyObject *fmt, Template *t, Py_ssize_t expected) {
    if (!is_ascii_str(fmt)) { PyErr_SetString(PyExc_TypeError, "template: an ASCII str"); return -1; }
    if (!keep(fmt)) return -1;
    const char *s = (const char *)PyUnicode_DATA(fmt);
    Py_ssize_t n = PyUnicode_GET_LENGTH(fmt), pieces = 1;
    for (Py_ssize_t i = 0; i + 1 < n; i++)
        if (s[i] == '%') {
            if (s[i + 1] != 's' && s[i + 1] != 'd') {
                PyErr_Format(PyExc_ValueError, "template: only %%s and %%d: %U", fmt);
                return -1;
            }
            pieces++; i++;
        }
    if (pieces != expected) {
        PyErr_Format(PyExc_ValueError, "template: %zd fields, not %zd: %U", pieces - 1, expected - 1, fmt);
        return -1;
    }
    PyMem_Free(t->text);
    PyMem_Free(t->len);
    t->n = pieces;
    t->text = PyMem_Calloc(pieces, sizeof(char *));
    t->len = PyMem_Calloc(pieces, sizeof(Py_ssize_t));
    if (!t->text || !t->len) { PyErr_NoMemory(); return -1; }
    Py_ssize_t k = 0, from = 0;
    for (Py_ssize_t i = 0; i + 1 < n; i++)
        if (s[i] == '%') {
            t->text[k] = s + from; t->len[k] = i - from; k++;
            from = i + 2; i++;
        }
    t->text[k] = s + from; t->len[k] = n - from;
    return 0;
}

/* configure_span(span_type, fields, prototype): the span type, its slot names in
 * Span's field order, and a span whose values past the first nine are the defaults. */
static PyObject *configure_span(PyObject *self, PyObject *args) {
    PyObject *type, *fields, *proto;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &type, &PyTuple_Type, &fields, &proto)) return NULL;
    if (PyTuple_GET_SIZE(fields) != N_FIELDS || Py_TYPE(proto) != (PyTypeObject *)type) {
        PyErr_SetString(PyExc_ValueError, "configure_span: the fields or the prototype do not fit");
        return NULL;
    }
    if (!keep(type) || !keep(proto)) return NULL;
    Py_ssize_t offset[N_FIELDS]; /* taken only once all are found */
    for (int f = 0; f < N_FIELDS; f++) {
        PyObject *d = PyObject_GetAttr(type, PyTuple_GET_ITEM(fields, f)); /* a slot: its member descriptor */
        int slot = d && Py_TYPE(d) == &PyMemberDescr_Type
                   && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (slot) offset[f] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_XDECREF(d);
        if (!slot) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "configure_span: %R is not a slot of the span type",
                         PyTuple_GET_ITEM(fields, f));
            return NULL;
        }
    }
    memcpy(field_offset, offset, sizeof(offset));
    span_type = (PyTypeObject *)type;
    for (int f = 0; f < N_FIELDS; f++) field_default[f] = FIELD(proto, f);
    Py_RETURN_NONE;
}

/* configure_events(frac, kind_client, marker_ns, long_ns, slice, slice_child, mark, long_client,
 *                  long_server, flows, marks): encode.py's tables and event templates. */
static PyObject *configure_events(PyObject *self, PyObject *args) {
    PyObject *frac, *sl, *slc, *mark, *lc, *ls, *flows, *marks;
    configured = 0; /* encode_spans() refuses to run on tables half replaced */
    if (!PyArg_ParseTuple(args, "O!lLLOOOOOO!O!", &PyTuple_Type, &frac, &kind_client, &marker_ns, &long_ns,
                          &sl, &slc, &mark, &lc, &ls, &PyTuple_Type, &flows, &PyTuple_Type, &marks))
        return NULL;
    if (PyTuple_GET_SIZE(frac) != 1000 || PyTuple_GET_SIZE(flows) != 4 || PyTuple_GET_SIZE(marks) != 4) {
        PyErr_SetString(PyExc_ValueError, "configure_events: frac, flows or marks do not fit");
        return NULL;
    }
    for (int r = 0; r < 1000; r++) {
        PyObject *s = PyTuple_GET_ITEM(frac, r);
        if (!is_ascii_str(s) || PyUnicode_GET_LENGTH(s) > 4) {
            PyErr_SetString(PyExc_ValueError, "configure_events: frac entries are short ASCII strs");
            return NULL;
        }
        frac_len[r] = (unsigned char)PyUnicode_GET_LENGTH(s);
        memcpy(frac_text[r], PyUnicode_DATA(s), frac_len[r]);
    }
    for (int k = 0; k < 4; k++) {
        if (!is_ascii_str(PyTuple_GET_ITEM(marks, k)) || !keep(PyTuple_GET_ITEM(marks, k))) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "configure_events: marks are ASCII strs");
            return NULL;
        }
        mark_name[k] = PyTuple_GET_ITEM(marks, k);
    }
    Template *flow[4] = {&t_flow_first_client, &t_flow_last_client, &t_flow_first_server, &t_flow_last_server};
    if (template_of(sl, &t_slice, 11) < 0 || template_of(slc, &t_slice_child, 12) < 0
        || template_of(mark, &t_mark, 7) < 0 || template_of(lc, &t_long_client, 15) < 0
        || template_of(ls, &t_long_server, 15) < 0)
        return NULL;
    for (int k = 0; k < 4; k++)
        if (template_of(PyTuple_GET_ITEM(flows, k), flow[k], 5) < 0) return NULL;
    configured = 1;
    Py_RETURN_NONE;
}

/* ---- line_spans() ------------------------------------------------------------------ */

static inline int hex_run(const char *p, int n) {
    for (int i = 0; i < n; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
    return 1;
}

/* Digits at p, up to a '"', as a long long; the position after the '"', or NULL (none, or too many). */
static inline const char *digits(const char *p, const char *end, long long *out) {
    long long v = 0;
    const char *q = p;
    while (q < end && *q >= '0' && *q <= '9') {
        int d = *q - '0';
        if (v > (LLONG_MAX - d) / 10) return NULL;
        v = v * 10 + d;
        q++;
    }
    if (q == p || q >= end || *q != '"') return NULL;
    *out = v;
    return q + 1;
}

static inline int lit(const char **p, const char *end, const char *s, Py_ssize_t n) {
    if (end - *p < n || memcmp(*p, s, n) != 0) return 0;
    *p += n;
    return 1;
}
#define LIT(p, end, s) lit(&(p), (end), (s), (Py_ssize_t)sizeof(s) - 1)

static PyObject *ascii_str(const char *s, Py_ssize_t n) {
    PyObject *o = PyUnicode_New(n, 127);
    if (o) memcpy(PyUnicode_DATA(o), s, n);
    return o;
}

/* The Span of one piece (a span's JSON without its leading {"traceId":" and closing }),
 * NULL without an error set: not the common case (Python reads it). */
static PyObject *piece_span(const char *p, const char *end, PyObject *sites, PyObject *no_site,
                            PyObject *res_worker, PyObject *fallback) {
    const char *trace = p, *span, *parent = NULL, *q = p;
    long long start, stop;
    if (end - q < 32 || !hex_run(q, 32)) return NULL;
    q += 32;
    if (!LIT(q, end, "\",\"spanId\":\"")) return NULL;
    span = q;
    if (end - q < 16 || !hex_run(q, 16)) return NULL;
    q += 16;
    if (!LIT(q, end, "\"")) return NULL;
    if (LIT(q, end, ",\"parentSpanId\":\"")) {
        parent = q;
        if (end - q < 16 || !hex_run(q, 16)) return NULL;
        q += 16;
        if (!LIT(q, end, "\"")) return NULL;
    }
    if (!LIT(q, end, ",\"startTimeUnixNano\":\"") || !(q = digits(q, end, &start))
        || !LIT(q, end, ",\"endTimeUnixNano\":\"") || !(q = digits(q, end, &stop)) || !LIT(q, end, ","))
        return NULL;
    if (start <= 0) return NULL;
    PyObject *tail = ascii_str(q, end - q);
    if (!tail) return NULL;
    PyObject *site = PyDict_GetItemWithError(sites, tail); /* borrowed */
    Py_DECREF(tail);
    if (!site || site == no_site || !PyTuple_Check(site) || PyTuple_GET_SIZE(site) != 4) return NULL;
    PyObject *route = PyTuple_GET_ITEM(site, 3);
    PyObject *worker = PyObject_IsTrue(res_worker) == 1 ? res_worker
                       : (route != Py_None && PyObject_IsTrue(route) == 1) ? route : fallback;
    PyObject *v[N_FIELDS] = {0};
    v[F_TRACE] = ascii_str(trace, 32);
    v[F_SPAN] = ascii_str(span, 16);
    v[F_PARENT] = parent ? ascii_str(parent, 16) : PyUnicode_New(0, 127);
    v[F_START] = PyLong_FromLongLong(start);
    v[F_END] = PyLong_FromLongLong(stop > start ? stop : start);
    PyObject *obj = span_type->tp_alloc(span_type, 0);
    if (!obj || !v[F_TRACE] || !v[F_SPAN] || !v[F_PARENT] || !v[F_START] || !v[F_END]) {
        for (int f = 0; f < N_FIELDS; f++) Py_XDECREF(v[f]);
        Py_XDECREF(obj);
        return NULL;
    }
    v[F_NAME] = Py_NewRef(PyTuple_GET_ITEM(site, 0));
    v[F_KIND] = Py_NewRef(PyTuple_GET_ITEM(site, 1));
    v[F_ATTRS] = Py_NewRef(PyTuple_GET_ITEM(site, 2));
    v[F_WORKER] = Py_NewRef(worker);
    for (int f = F_STATUS; f < N_FIELDS; f++) v[f] = Py_NewRef(field_default[f]);
    for (int f = 0; f < N_FIELDS; f++) FIELD(obj, f) = v[f];
    return obj;
}

/* The first ``pat`` in [p, end), or NULL (memmem is not everywhere). */
static const char *find(const char *p, const char *end, const char *pat, Py_ssize_t n) {
    while (end - p >= n && (p = memchr(p, pat[0], end - p - n + 1)) != NULL) {
        if (memcmp(p, pat, n) == 0) return p;
        p++;
    }
    return NULL;
}

/* line_spans(text, lo, hi, sites, no_site, res_worker, fallback) -> (spans, holes) | None
 *
 * The spans of text[lo:hi], the pieces between '},{"traceId":"' separators; a piece
 * this code leaves to Python stays in ``spans`` as its str, its index in ``holes``.
 * None: text is not ASCII (Python reads the line). */
static PyObject *line_spans(PyObject *self, PyObject *args) {
    PyObject *text, *sites, *no_site, *res_worker, *fallback;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "UnnO!OOO", &text, &lo, &hi, &PyDict_Type, &sites, &no_site, &res_worker, &fallback))
        return NULL;
    if (!span_type) { PyErr_SetString(PyExc_RuntimeError, "configure_span() first"); return NULL; }
    if (!PyUnicode_IS_COMPACT_ASCII(text) || lo < 0 || hi > PyUnicode_GET_LENGTH(text) || lo > hi)
        Py_RETURN_NONE;
    static const char sep[] = "},{\"traceId\":\"";
    const Py_ssize_t sep_len = sizeof(sep) - 1;
    const char *base = (const char *)PyUnicode_DATA(text), *p = base + lo, *end = base + hi;
    PyObject *spans = PyList_New(0), *holes = PyList_New(0);
    if (!spans || !holes) goto fail;
    for (;;) {
        const char *next = find(p, end, sep, sep_len);
        const char *stop = next ? next : end;
        PyObject *item = piece_span(p, stop, sites, no_site, res_worker, fallback);
        if (!item) {
            if (PyErr_Occurred()) goto fail;
            PyObject *idx = PyLong_FromSsize_t(PyList_GET_SIZE(spans));
            item = ascii_str(p, stop - p);
            if (!idx || !item || PyList_Append(holes, idx) < 0) { Py_XDECREF(idx); Py_XDECREF(item); goto fail; }
            Py_DECREF(idx);
        }
        int err = PyList_Append(spans, item);
        Py_DECREF(item);
        if (err < 0) goto fail;
        if (!next) break;
        p = next + sep_len;
    }
    PyObject *out = PyTuple_Pack(2, spans, holes);
    Py_DECREF(spans);
    Py_DECREF(holes);
    return out;
fail:
    Py_XDECREF(spans);
    Py_XDECREF(holes);
    return NULL;
}

/* ---- encode_spans() ------------------------------------------------------------------- */

/* One value of a template: a str, an integer, or microseconds (two %s: whole and fraction). */
typedef struct { char type; PyObject *s; long long i; } Val;
#define VS(x) ((Val){'s', (x), 0})
#define VI(x) ((Val){'i', NULL, (x)})
#define VF(r) ((Val){'f', NULL, (r)}) /* the fraction text of r = ns % 1000 */

static int emit(Buf *b, const Template *t, const Val *v) {
    for (Py_ssize_t k = 0; k < t->n; k++) {
        if (buf_put(b, t->text[k], t->len[k]) < 0) return -1;
        if (k + 1 == t->n) break;
        const Val *x = &v[k];
        int err = x->type == 's' ? buf_str(b, x->s)
                  : x->type == 'i' ? buf_int(b, x->i)
                  : buf_put(b, frac_text[x->i], frac_len[x->i]);
        if (err < 0) return -1;
    }
    return 0;
}

static inline long long as_ll(PyObject *o, int *ok) {
    if (!PyLong_CheckExact(o)) { *ok = 0; return 0; }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); *ok = 0; }
    return v;
}

/* The site parts (head, kind, tail) of a span: from ``parts`` by id(attrs), else made by slice_parts(s). */
static PyObject *site_parts(PyObject *s, PyObject *parts, PyObject *slice_parts) {
    PyObject *key = PyLong_FromVoidPtr(FIELD(s, F_ATTRS));
    if (!key) return NULL;
    PyObject *site = PyDict_GetItemWithError(parts, key);
    if (!site) {
        if (PyErr_Occurred() || !(site = PyObject_CallOneArg(slice_parts, s))) { Py_DECREF(key); return NULL; }
        int err = PyDict_SetItem(parts, key, site);
        Py_DECREF(site); /* the dict holds it */
        if (err < 0) { Py_DECREF(key); return NULL; }
    }
    Py_DECREF(key);
    return site;
}

/* encode_spans(group, i, chunk, zero_ns, lanes, base_tid, first_flow_id, parts, slice_parts)
 *   -> (text, events, next, leave)
 *
 * Encodes group[i:] until ``chunk`` spans are done, the end, or a span this code leaves
 * to Python (``leave``: group[next] is that span): an error, a time before the merged
 * timeline's zero, a non-ASCII text. */
static PyObject *encode_spans(PyObject *self, PyObject *args) {
    PyObject *group, *lanes, *parts, *slice_parts;
    Py_ssize_t i, chunk;
    long long zero_ns, base_tid, first_flow_id;
    if (!PyArg_ParseTuple(args, "O!nnLO!LLO!O", &PyList_Type, &group, &i, &chunk, &zero_ns, &PyList_Type, &lanes,
                          &base_tid, &first_flow_id, &PyDict_Type, &parts, &slice_parts))
        return NULL;
    if (!span_type || !configured) {
        PyErr_SetString(PyExc_RuntimeError, "configure_span() and configure_events() first");
        return NULL;
    }
    Buf b = {0};
    Py_ssize_t n_group = PyList_GET_SIZE(group), done = 0, events = 0;
    int leave = 0;
    for (; i < n_group && done < chunk; i++, done++) {
        PyObject *s = PyList_GET_ITEM(group, i);
        if (Py_TYPE(s) != span_type) { leave = 1; break; }
        int ok = 1;
        long long start = as_ll(FIELD(s, F_START), &ok), end = as_ll(FIELD(s, F_END), &ok);
        long long tid = as_ll(FIELD(s, F_TID), &ok), pair = as_ll(FIELD(s, F_PAIR), &ok);
        long long status = as_ll(FIELD(s, F_STATUS), &ok), kind = as_ll(FIELD(s, F_KIND), &ok);
        if (!ok || status == 2 || start < zero_ns || end < start || tid < base_tid
            || tid - base_tid >= PyList_GET_SIZE(lanes)) { leave = 1; break; }
        long long ts = start - zero_ns, dur = end - start;
        PyObject *lane = PyList_GET_ITEM(lanes, tid - base_tid);
        PyObject *trace = FIELD(s, F_TRACE), *span = FIELD(s, F_SPAN), *parent = FIELD(s, F_PARENT);
        if (!is_ascii_str(lane) || !is_ascii_str(trace) || !is_ascii_str(span) || !is_ascii_str(parent)) {
            leave = 1;
            break;
        }
        PyObject *site = site_parts(s, parts, slice_parts);
        if (!site) goto fail;
        if (!PyTuple_CheckExact(site) || PyTuple_GET_SIZE(site) != 3 || !is_ascii_str(PyTuple_GET_ITEM(site, 0))
            || !is_ascii_str(PyTuple_GET_ITEM(site, 1)) || !is_ascii_str(PyTuple_GET_ITEM(site, 2))) {
            leave = 1;
            break;
        }
        if (b.len && buf_put(&b, ",", 1) < 0) goto fail;
        PyObject *head = PyTuple_GET_ITEM(site, 0), *kind_text = PyTuple_GET_ITEM(site, 1);
        PyObject *tail = PyTuple_GET_ITEM(site, 2);
        int err;
        if (PyUnicode_GET_LENGTH(parent)) {
            Val v[] = {VS(head), VS(lane), VI(ts / 1000), VF(ts % 1000), VI(dur / 1000), VF(dur % 1000),
                       VS(trace), VS(span), VS(kind_text), VS(parent), VS(tail)};
            err = emit(&b, &t_slice_child, v);
        } else {
            Val v[] = {VS(head), VS(lane), VI(ts / 1000), VF(ts % 1000), VI(dur / 1000), VF(dur % 1000),
                       VS(trace), VS(span), VS(kind_text), VS(tail)};
            err = emit(&b, &t_slice, v);
        }
        if (err < 0) goto fail;
        events++;
        if (pair < 0) continue;
        long long fid = first_flow_id + 2 * pair;
        int client = kind == kind_client;
        if (dur >= long_ns) { /* the usual case: 1 us markers, flows at their middles */
            long long q0 = ts / 1000, r0 = ts % 1000, qe = (ts + dur) / 1000, re = (ts + dur) % 1000;
            long long up0 = (r0 + 500) / 1000, upe = (re + 500) / 1000;
            Val v[] = {VS(lane), VI(q0 + 1), VF(r0), VS(lane), VI(qe - 2), VF(re),
                       VI(fid), VS(lane), VI(q0 + 1 + up0), VF((r0 + 500) % 1000),
                       VI(fid + 1), VS(lane), VI(qe - 2 + upe), VF((re + 500) % 1000)};
            err = buf_put(&b, ",", 1) < 0 || emit(&b, client ? &t_long_client : &t_long_server, v) < 0 ? -1 : 0;
            events += 4;
        } else { /* encode._short_ends */
            long long a, bb;
            err = 0;
            if (dur < marker_ns) {
                a = bb = ts + dur / 2;
                events += 2;
            } else {
                long long m = dur / 8 < marker_ns ? dur / 8 : marker_ns, a0 = ts + m, b0 = ts + dur - 2 * m;
                Val v1[] = {VS(client ? mark_name[0] : mark_name[2]), VS(lane), VI(a0 / 1000),
                            VF(a0 % 1000), VI(m / 1000), VF(m % 1000)};
                Val v2[] = {VS(client ? mark_name[1] : mark_name[3]), VS(lane), VI(b0 / 1000),
                            VF(b0 % 1000), VI(m / 1000), VF(m % 1000)};
                err = buf_put(&b, ",", 1) < 0 || emit(&b, &t_mark, v1) < 0 || buf_put(&b, ",", 1) < 0
                      || emit(&b, &t_mark, v2) < 0 ? -1 : 0;
                a = a0 + m / 2;
                bb = b0 + m / 2;
                events += 4;
            }
            Val f1[] = {VI(fid), VS(lane), VI(a / 1000), VF(a % 1000)};
            Val f2[] = {VI(fid + 1), VS(lane), VI(bb / 1000), VF(bb % 1000)};
            if (!err)
                err = buf_put(&b, ",", 1) < 0
                      || emit(&b, client ? &t_flow_first_client : &t_flow_first_server, f1) < 0
                      || buf_put(&b, ",", 1) < 0
                      || emit(&b, client ? &t_flow_last_client : &t_flow_last_server, f2) < 0 ? -1 : 0;
        }
        if (err < 0) goto fail;
    }
    PyObject *text = ascii_str(b.p ? b.p : "", b.len);
    PyMem_Free(b.p);
    if (!text) return NULL;
    return Py_BuildValue("(NnnO)", text, events, i, leave ? Py_True : Py_False);
fail:
    PyMem_Free(b.p);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure_span", configure_span, METH_VARARGS, "The span type, its slot names and a prototype span."},
    {"configure_events", configure_events, METH_VARARGS, "encode.py's tables and event templates."},
    {"line_spans", line_spans, METH_VARARGS, "The spans of one span-file line's span pieces."},
    {"encode_spans", encode_spans, METH_VARARGS, "A lane group's encoded events, a chunk at a time."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups",
                                    "C loops of rpc-observe merge (see _speedups.c).", -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
