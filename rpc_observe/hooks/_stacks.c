/* rpc_observe.hooks._stacks: other threads' Python stacks, read in one step.
 *
 * Walking another thread's frames from Python (traceback.walk_stack) runs bytecode, so the
 * interpreter may hand the GIL to that thread halfway; the thread then pops the frames being
 * walked, and CPython 3.11 can crash in frame.f_back (measured: 2 segfaults in 12 loaded runs).
 * Here no bytecode runs and the collector is off, so the GIL is held from the first frame to
 * the last: every thread is parked at a point where its frames are whole, the way a debugger
 * sees them.  The collector off also avoids CPython 3.11's deadlock of sys._current_frames()
 * (gh-106883: a collection under the thread-list lock ran a finalizer that released the GIL).
 *
 * Only each frame's file, line and function are read: never locals or arguments.  Built when
 * a C compiler is there (hatch_build.py); snapshot.py has the Python reference and fallback.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* "file:line in function" of `frame` and of the frames under it, innermost last; NULL on error. */
static PyObject *
walk(PyFrameObject *top, Py_ssize_t limit)
{
    PyObject *lines = PyList_New(0);
    if (lines == NULL) {
        return NULL;
    }
    PyFrameObject *frame = (PyFrameObject *)Py_NewRef(top);
    for (Py_ssize_t n = 0; frame != NULL && n < limit; n++) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *line = PyUnicode_FromFormat("%U:%d in %U", code->co_filename, PyFrame_GetLineNumber(frame),
                                              code->co_name);
        Py_DECREF(code);
        if (line == NULL || PyList_Append(lines, line) < 0) {
            Py_XDECREF(line);
            Py_DECREF(frame);
            Py_DECREF(lines);
            return NULL;
        }
        Py_DECREF(line);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    if (PyList_Reverse(lines) < 0) {
        Py_DECREF(lines);
        return NULL;
    }
    return lines;
}

static PyObject *
stacks(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *idents;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On:stacks", &idents, &limit)) {
        return NULL;
    }
    PyObject *wanted = PySequence_Fast(idents, "stacks() wants a sequence of thread idents");
    if (wanted == NULL) {
        return NULL;
    }
    PyObject *current_frames = PySys_GetObject("_current_frames"); /* borrowed */
    PyObject *result = PyDict_New();
    if (current_frames == NULL || result == NULL) {
        Py_DECREF(wanted);
        Py_XDECREF(result);
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "sys._current_frames is missing");
        }
        return NULL;
    }
    int collector_was_on = PyGC_Disable();
    PyObject *frames = PyObject_CallNoArgs(current_frames);
    if (frames != NULL && PyDict_Check(frames)) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(wanted); i++) {
            PyObject *ident = PySequence_Fast_GET_ITEM(wanted, i);
            PyObject *frame = PyDict_GetItemWithError(frames, ident); /* borrowed */
            if (frame == NULL) {
                if (PyErr_Occurred()) {
                    break;
                }
                continue; /* that thread has no Python frame now */
            }
            if (!PyFrame_Check(frame)) {
                continue;
            }
            PyObject *lines = walk((PyFrameObject *)frame, limit);
            if (lines == NULL || PyDict_SetItem(result, ident, lines) < 0) {
                Py_XDECREF(lines);
                break;
            }
            Py_DECREF(lines);
        }
    }
    Py_XDECREF(frames);
    if (collector_was_on) {
        PyGC_Enable();
    }
    Py_DECREF(wanted);
    if (PyErr_Occurred()) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"stacks", stacks, METH_VARARGS,
     "stacks(idents, limit) -> {ident: ['file:line in function', ...]} (innermost last, at most limit frames)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT, .m_name = "_stacks", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__stacks(void)
{
    return PyModule_Create(&module);
}
