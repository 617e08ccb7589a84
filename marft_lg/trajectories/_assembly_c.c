/* The C fast path of assembly's dependency function (assembly._dependencies).
 *
 * `dependencies(tasks, steps, actions, messages_at, completion_at, depends_on_at, min_chars)` fills each action
 * row's `depends_on` with the sorted orders of the earlier actions it could see: earlier actions of the same node
 * run (task), the latest action of each node run in the latest earlier LangGraph step, and every earlier action
 * whose stripped completion (at least `min_chars` long) appears in this action's prompt (its messages' contents
 * joined by newlines). It returns True, or NotImplemented, before changing anything, when an input is not of the
 * usual types (a step that is not an int, a message that is not a dict, ...): the Python version then runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *str_content = NULL, *str_newline = NULL;

/* The completion `c` stripped (as str.strip does) when at least `min_chars` long, else Py_None; NULL on error;
 * *usual 0 when `c` is not a str (nor None/""). */
static PyObject *quoted_text(PyObject *c, Py_ssize_t min_chars, int *usual) {
    if (c == Py_None) return Py_NewRef(Py_None);
    if (!PyUnicode_CheckExact(c)) {
        *usual = 0;
        return Py_NewRef(Py_None);
    }
    Py_ssize_t lo = 0, hi = PyUnicode_GET_LENGTH(c);
    const int kind = PyUnicode_KIND(c);
    const void *data = PyUnicode_DATA(c);
    while (lo < hi && Py_UNICODE_ISSPACE(PyUnicode_READ(kind, data, lo))) lo++;
    while (hi > lo && Py_UNICODE_ISSPACE(PyUnicode_READ(kind, data, hi - 1))) hi--;
    if (hi - lo < min_chars) return Py_NewRef(Py_None);
    return PyUnicode_Substring(c, lo, hi);
}

/* formats/base.messages_text: the messages' contents (str(content), "" when falsy) joined by newlines; NULL with
 * *usual 0 when `messages` is not a list of dicts. */
static PyObject *prompt_text(PyObject *messages, int *usual) {
    if (!PyList_CheckExact(messages)) {
        *usual = 0;
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(messages);
    if (n == 0) return PyUnicode_FromStringAndSize(NULL, 0);
    PyObject *parts = PyList_New(n);
    if (parts == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *m = PyList_GET_ITEM(messages, k), *part;
        if (!PyDict_CheckExact(m)) {
            *usual = 0;
            Py_DECREF(parts);
            return NULL;
        }
        PyObject *content = PyDict_GetItemWithError(m, str_content);
        if (content == NULL && PyErr_Occurred()) {
            Py_DECREF(parts);
            return NULL;
        }
        int truth = content == NULL ? 0 : PyObject_IsTrue(content);
        if (truth < 0) {
            Py_DECREF(parts);
            return NULL;
        }
        part = truth ? PyObject_Str(content) : PyUnicode_FromStringAndSize(NULL, 0);
        if (part == NULL) {
            Py_DECREF(parts);
            return NULL;
        }
        PyList_SET_ITEM(parts, k, part);
    }
    PyObject *text = PyUnicode_Join(str_newline, parts);
    Py_DECREF(parts);
    return text;
}

static PyObject *dependencies(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "dependencies(tasks, steps, actions, messages_at, completion_at, "
                                         "depends_on_at, min_chars) takes 7 arguments");
        return NULL;
    }
    PyObject *tasks = args[0], *steps = args[1], *actions = args[2];
    const Py_ssize_t at_messages = PyLong_AsSsize_t(args[3]), at_completion = PyLong_AsSsize_t(args[4]);
    const Py_ssize_t at_deps = PyLong_AsSsize_t(args[5]), min_chars = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(tasks) || !PyList_CheckExact(steps) || !PyList_CheckExact(actions)) Py_RETURN_NOTIMPLEMENTED;
    const Py_ssize_t n = PyList_GET_SIZE(actions);
    if (PyList_GET_SIZE(tasks) != n || PyList_GET_SIZE(steps) != n) Py_RETURN_NOTIMPLEMENTED;

    PyObject *result = NULL, *task_ids = NULL, *quoted = NULL, *deps_lists = NULL;
    Py_ssize_t *tid = NULL, *seen = NULL;  /* seen[task id] == i + 1: that node run's latest action is found */
    long long *step = NULL;
    char *has_step = NULL, *dep = NULL;
    int usual = 1;
    tid = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    seen = PyMem_Calloc((size_t)(n + 1), sizeof(Py_ssize_t));
    step = PyMem_Malloc(sizeof(long long) * (size_t)(n + 1));
    has_step = PyMem_Malloc((size_t)(n + 1));
    dep = PyMem_Malloc((size_t)(n + 1));
    task_ids = PyDict_New();
    quoted = PyList_New(n);
    deps_lists = PyList_New(n);
    if (tid == NULL || seen == NULL || step == NULL || has_step == NULL || dep == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (task_ids == NULL || quoted == NULL || deps_lists == NULL) goto done;

    /* the inputs, checked before anything changes: task ids as small ints, steps, stripped completions */
    Py_ssize_t first_quoted = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(actions, i), *s = PyList_GET_ITEM(steps, i);
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) <= at_messages || PyList_GET_SIZE(row) <= at_completion ||
            PyList_GET_SIZE(row) <= at_deps) {
            usual = 0;
            goto done;
        }
        PyObject *known = PyDict_GetItemWithError(task_ids, PyList_GET_ITEM(tasks, i));
        if (known == NULL) {
            if (PyErr_Occurred()) goto done;
            PyObject *id = PyLong_FromSsize_t(PyDict_GET_SIZE(task_ids));
            if (id == NULL || PyDict_SetItem(task_ids, PyList_GET_ITEM(tasks, i), id) < 0) {
                Py_XDECREF(id);
                goto done;
            }
            Py_DECREF(id);
            tid[i] = PyDict_GET_SIZE(task_ids) - 1;
        } else {
            tid[i] = PyLong_AsSsize_t(known);
        }
        has_step[i] = s != Py_None;
        if (s != Py_None) {
            int overflow;
            if (!PyLong_CheckExact(s) || ((step[i] = PyLong_AsLongLongAndOverflow(s, &overflow)), overflow)) {
                usual = 0;
                goto done;
            }
        }
        PyObject *text = quoted_text(PyList_GET_ITEM(row, at_completion), min_chars, &usual);
        if (text == NULL) goto done;
        PyList_SET_ITEM(quoted, i, text);
        if (!usual) goto done;
        if (text != Py_None && first_quoted == n) first_quoted = i;
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        memset(dep, 0, (size_t)i);
        int below_found = 0;
        long long below = 0;  /* the latest earlier step: the largest earlier step < this one */
        for (Py_ssize_t j = 0; j < i; j++) {
            if (tid[j] == tid[i]) dep[j] = 1;
            if (has_step[i] && has_step[j] && step[j] < step[i] && (!below_found || step[j] > below)) {
                below = step[j];
                below_found = 1;
            }
        }
        if (below_found) {  /* the latest action of each node run in that step */
            for (Py_ssize_t j = i - 1; j >= 0; j--) {
                if (has_step[j] && step[j] == below && seen[tid[j]] != i + 1) {
                    seen[tid[j]] = i + 1;
                    dep[j] = 1;
                }
            }
        }
        if (first_quoted < i) {
            PyObject *prompt = prompt_text(PyList_GET_ITEM(PyList_GET_ITEM(actions, i), at_messages), &usual);
            if (prompt == NULL) goto done;
            for (Py_ssize_t j = first_quoted; j < i; j++) {
                PyObject *text = PyList_GET_ITEM(quoted, j);
                if (text == Py_None) continue;
                int found = PyUnicode_Contains(prompt, text);
                if (found < 0) {
                    Py_DECREF(prompt);
                    goto done;
                }
                if (found) dep[j] = 1;
            }
            Py_DECREF(prompt);
        }
        Py_ssize_t count = 0;
        for (Py_ssize_t j = 0; j < i; j++) count += dep[j];
        PyObject *list = PyList_New(count);
        if (list == NULL) goto done;
        for (Py_ssize_t j = 0, k = 0; j < i; j++) {
            if (!dep[j]) continue;
            PyObject *order = PyLong_FromSsize_t(j);
            if (order == NULL) {
                Py_DECREF(list);
                goto done;
            }
            PyList_SET_ITEM(list, k++, order);
        }
        PyList_SET_ITEM(deps_lists, i, list);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *list = PyList_GET_ITEM(deps_lists, i);
        Py_INCREF(list);
        PyList_SetItem(PyList_GET_ITEM(actions, i), at_deps, list);  /* steals `list` */
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(tid);
    PyMem_Free(seen);
    PyMem_Free(step);
    PyMem_Free(has_step);
    PyMem_Free(dep);
    Py_XDECREF(task_ids);
    Py_XDECREF(quoted);
    Py_XDECREF(deps_lists);
    if (result == NULL && !usual && !PyErr_Occurred()) Py_RETURN_NOTIMPLEMENTED;
    return result;
}

static PyMethodDef methods[] = {
    {"dependencies", (PyCFunction)(void (*)(void))dependencies, METH_FASTCALL,
     "dependencies(tasks, steps, actions, messages_at, completion_at, depends_on_at, min_chars) -> True, or "
     "NotImplemented for inputs of other types (assembly._dependencies)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_assembly_c",
                                        "C fast path of marft_lg's trajectory assembly.", -1, methods};

PyMODINIT_FUNC PyInit__assembly_c(void) {
    str_content = PyUnicode_InternFromString("content");
    str_newline = PyUnicode_FromString("\n");
    if (str_content == NULL || str_newline == NULL) return NULL;
    return PyModule_Create(&module_def);
}
