/* The C fast path of marft_lg's column conversions (flat_columns.py).
 *
 * `split_lists(values, offsets, valid, shared)` turns a flat int64 or float64 array plus row offsets into one
 * Python list per row (None where the row has no value). Integers below len(shared) are the shared objects of
 * that list instead of new ones: a 40-token prompt then costs its list, not 40 new int objects. This is what
 * `TokenColumn.to_lists` does in numpy and Python, without the flat object list in between (a step per value
 * in C instead of an object array, a flat list and a slice per row).
 *
 * `utf8_column(values)` lays a list of str (or None) out as Arrow's large_string column: the UTF-8 bytes of all
 * values, int64 offsets and a validity byte per row; None when a value is anything else (or a str that has no
 * UTF-8 form), and the caller keeps the list. A mining worker ships a string column as these three buffers, and
 * the parent wraps them as an Arrow array without creating a str object per row.
 *
 * `b64_column(values, prefix)` decodes a list of prefixed base64 texts (marft_lg's "i32:..." token ids) into one
 * buffer: the bytes, int64 byte offsets and a validity byte per row (None rows are not valid). It accepts only
 * canonical base64 (the alphabet, '=' padding at the end, a length that is a multiple of 4), where it equals
 * binascii.a2b_base64; anything else gives None and the caller decodes the column value by value.
 *
 * `number_column(values, floats)` lays a list of int (or, with `floats`, float) values and None out as int64 or
 * float64 bytes (0 or NaN where None) and a validity byte per row; None when a value is of another type or an int
 * does not fit in 64 bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != itemsize || view->ndim != 1) {
        PyErr_Format(PyExc_TypeError, "split_lists: %s must be a 1-d array of %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *split_lists(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "split_lists(values, offsets, valid, shared) takes 4 arguments");
        return NULL;
    }
    PyObject *shared = args[3];
    if (shared != Py_None && !PyList_CheckExact(shared)) {
        PyErr_SetString(PyExc_TypeError, "split_lists: shared must be a list of ints or None");
        return NULL;
    }
    Py_buffer vals, offs, ok;
    if (get_buffer(args[0], &vals, 8, "values") < 0) return NULL;
    if (get_buffer(args[1], &offs, 8, "offsets") < 0) {
        PyBuffer_Release(&vals);
        return NULL;
    }
    if (get_buffer(args[2], &ok, 1, "valid") < 0) {
        PyBuffer_Release(&vals);
        PyBuffer_Release(&offs);
        return NULL;
    }
    const char *fmt = vals.format != NULL ? vals.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    const int floats = fmt[0] == 'd';
    if (!(fmt[0] == 'd' || fmt[0] == 'q' || fmt[0] == 'l') || fmt[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "split_lists: values must be int64 or float64, not format %s", vals.format);
        PyBuffer_Release(&vals);
        PyBuffer_Release(&offs);
        PyBuffer_Release(&ok);
        return NULL;
    }
    const Py_ssize_t rows = ok.shape[0], n_values = vals.shape[0];
    const int64_t *off = offs.buf;
    const int64_t *ints = vals.buf;
    const double *dbls = vals.buf;
    const char *valid = ok.buf;
    const Py_ssize_t n_shared = shared == Py_None ? 0 : PyList_GET_SIZE(shared);
    PyObject *out = NULL;
    if (offs.shape[0] != rows + 1) {
        PyErr_SetString(PyExc_ValueError, "split_lists: offsets must hold one more item than valid");
        goto done;
    }
    out = PyList_New(rows);
    if (out == NULL) goto done;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (!valid[r]) {
            PyList_SET_ITEM(out, r, Py_NewRef(Py_None));
            continue;
        }
        const int64_t lo = off[r], hi = off[r + 1];
        if (lo < 0 || hi < lo || hi > n_values) {
            PyErr_Format(PyExc_ValueError, "split_lists: row %zd has offsets %lld..%lld outside 0..%zd", r,
                         (long long)lo, (long long)hi, n_values);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *row = PyList_New((Py_ssize_t)(hi - lo));
        if (row == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, r, row);
        for (int64_t k = lo; k < hi; k++) {
            PyObject *item;
            if (floats) {
                item = PyFloat_FromDouble(dbls[k]);
            } else if (ints[k] >= 0 && ints[k] < n_shared) {
                item = Py_NewRef(PyList_GET_ITEM(shared, (Py_ssize_t)ints[k]));
            } else {
                item = PyLong_FromLongLong((long long)ints[k]);
            }
            if (item == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(row, (Py_ssize_t)(k - lo), item);
        }
    }
done:
    PyBuffer_Release(&vals);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&ok);
    return out;
}

enum { OK = 0, DECLINE = 1, FAIL = -1 };

/* Measures a value of a byte column: OK with its size in *n, DECLINE, or FAIL (an exception is set). */
typedef int (*measure_fn)(PyObject *v, const void *ctx, Py_ssize_t *n);
/* Writes a measured value's bytes to `dest`: OK, DECLINE, or FAIL. */
typedef int (*write_fn)(PyObject *v, const void *ctx, char *dest);

/* A list of values (None: a row without one) laid out as (bytes, int64 byte offsets, validity bytes); None when
 * `measure` or `write` declines a value. */
static PyObject *byte_column(PyObject *values, measure_fn measure, write_fn write, const void *ctx) {
    const Py_ssize_t rows = PyList_GET_SIZE(values);
    Py_ssize_t total = 0, n;
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *v = PyList_GET_ITEM(values, r);
        if (v == Py_None) continue;
        int m = measure(v, ctx, &n);
        if (m == FAIL) return NULL;
        if (m == DECLINE) Py_RETURN_NONE;
        total += n;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, total);
    PyObject *offsets = PyBytes_FromStringAndSize(NULL, (rows + 1) * (Py_ssize_t)sizeof(int64_t));
    PyObject *valid = PyBytes_FromStringAndSize(NULL, rows);
    int r = FAIL;
    if (data == NULL || offsets == NULL || valid == NULL) goto fail;
    char *d = PyBytes_AS_STRING(data), *ok = PyBytes_AS_STRING(valid);
    int64_t *off = (int64_t *)PyBytes_AS_STRING(offsets);
    int64_t at = 0;
    off[0] = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        ok[i] = v != Py_None;
        if (v != Py_None) {
            if ((r = measure(v, ctx, &n)) != OK || (r = write(v, ctx, d + at)) != OK) goto fail;
            at += n;
        }
        off[i + 1] = at;
    }
    return Py_BuildValue("(NNN)", data, offsets, valid);
fail:
    Py_XDECREF(data);
    Py_XDECREF(offsets);
    Py_XDECREF(valid);
    if (r == DECLINE) Py_RETURN_NONE;
    return NULL;
}

static int utf8_measure(PyObject *v, const void *ctx, Py_ssize_t *n) {
    if (!PyUnicode_CheckExact(v)) return DECLINE;
    if (PyUnicode_AsUTF8AndSize(v, n) != NULL) return OK;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return FAIL;
    PyErr_Clear();  /* a lone surrogate: the caller's general path decides */
    return DECLINE;
}

static int utf8_write(PyObject *v, const void *ctx, char *dest) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(v, &n);  /* cached by utf8_measure */
    memcpy(dest, u, (size_t)n);
    return OK;
}

static PyObject *utf8_column(PyObject *module, PyObject *values) {
    if (!PyList_CheckExact(values)) {
        PyErr_SetString(PyExc_TypeError, "utf8_column: values must be a list");
        return NULL;
    }
    return byte_column(values, utf8_measure, utf8_write, NULL);
}

static signed char B64[256];

static void init_b64(void) {
    memset(B64, -1, sizeof B64);
    const char *alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; i++) B64[(unsigned char)alphabet[i]] = (signed char)i;
}

typedef struct {
    const char *prefix;
    Py_ssize_t n;
} Prefix;

/* The base64 text of `v` after the prefix (an ASCII str that starts with it), or NULL. */
static const unsigned char *b64_text(PyObject *v, const Prefix *prefix, Py_ssize_t *n) {
    if (!PyUnicode_CheckExact(v) || !PyUnicode_IS_ASCII(v)) return NULL;
    const Py_ssize_t len = PyUnicode_GET_LENGTH(v), np = prefix->n;
    const unsigned char *p = PyUnicode_1BYTE_DATA(v);
    if (len < np || memcmp(p, prefix->prefix, (size_t)np) != 0 || (len - np) % 4 != 0) return NULL;
    *n = len - np;
    return p + np;
}

static inline Py_ssize_t b64_size(const unsigned char *t, Py_ssize_t n) {
    if (n == 0) return 0;
    return n / 4 * 3 - (t[n - 1] == '=') - (t[n - 2] == '=');
}

/* Decode canonical base64 `t` (n a multiple of 4) into `out`; -1 when it is not canonical. */
static int b64_decode(const unsigned char *t, Py_ssize_t n, unsigned char *out) {
    for (Py_ssize_t i = 0; i < n; i += 4) {
        const int last = i + 4 == n;
        const int a = B64[t[i]], b = B64[t[i + 1]];
        int c = B64[t[i + 2]], d = B64[t[i + 3]];
        if (a < 0 || b < 0) return -1;
        *out++ = (unsigned char)(a << 2 | b >> 4);
        if (last && t[i + 2] == '=') {
            if (t[i + 3] != '=') return -1;
            break;
        }
        if (c < 0) return -1;
        *out++ = (unsigned char)(b << 4 | c >> 2);
        if (last && t[i + 3] == '=') break;
        if (d < 0) return -1;
        *out++ = (unsigned char)(c << 6 | d);
    }
    return 0;
}

static int b64_measure(PyObject *v, const void *ctx, Py_ssize_t *n) {
    Py_ssize_t tn;
    const unsigned char *t = b64_text(v, ctx, &tn);
    if (t == NULL) return DECLINE;
    *n = b64_size(t, tn);
    return OK;
}

static int b64_write(PyObject *v, const void *ctx, char *dest) {
    Py_ssize_t tn;
    const unsigned char *t = b64_text(v, ctx, &tn);
    return b64_decode(t, tn, (unsigned char *)dest) < 0 ? DECLINE : OK;  /* not canonical: the general path decides */
}

static PyObject *b64_column(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "b64_column(values: list, prefix: str)");
        return NULL;
    }
    Prefix prefix;
    if ((prefix.prefix = PyUnicode_AsUTF8AndSize(args[1], &prefix.n)) == NULL) return NULL;
    return byte_column(args[0], b64_measure, b64_write, &prefix);
}

static PyObject *number_column(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "number_column(values: list, floats: bool)");
        return NULL;
    }
    PyObject *values = args[0];
    const int floats = PyObject_IsTrue(args[1]);
    if (floats < 0) return NULL;
    const Py_ssize_t rows = PyList_GET_SIZE(values);
    PyObject *data = PyBytes_FromStringAndSize(NULL, rows * 8);
    PyObject *valid = PyBytes_FromStringAndSize(NULL, rows);
    if (data == NULL || valid == NULL) goto fail;
    int64_t *ints = (int64_t *)PyBytes_AS_STRING(data);
    double *dbls = (double *)PyBytes_AS_STRING(data);
    char *ok = PyBytes_AS_STRING(valid);
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *v = PyList_GET_ITEM(values, r);
        ok[r] = v != Py_None;
        if (v == Py_None) {
            if (floats) dbls[r] = Py_NAN;
            else ints[r] = 0;
        } else if (floats && PyFloat_CheckExact(v)) {
            dbls[r] = PyFloat_AS_DOUBLE(v);
        } else if (!floats && PyLong_CheckExact(v)) {
            int overflow;
            ints[r] = (int64_t)PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow) goto decline;
        } else {
            goto decline;
        }
    }
    return Py_BuildValue("(NN)", data, valid);
decline:
    Py_DECREF(data);
    Py_DECREF(valid);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(data);
    Py_XDECREF(valid);
    return NULL;
}

static PyMethodDef methods[] = {
    {"split_lists", (PyCFunction)(void (*)(void))split_lists, METH_FASTCALL,
     "split_lists(values, offsets, valid, shared) -> one list per row (None where not valid)."},
    {"utf8_column", utf8_column, METH_O,
     "utf8_column(list of str/None) -> (utf-8 bytes, int64 offsets bytes, validity bytes), or None."},
    {"b64_column", (PyCFunction)(void (*)(void))b64_column, METH_FASTCALL,
     "b64_column(values, prefix) -> (decoded bytes, int64 byte offsets, validity bytes), or None."},
    {"number_column", (PyCFunction)(void (*)(void))number_column, METH_FASTCALL,
     "number_column(values, floats) -> (int64 or float64 bytes, validity bytes), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_columns_c",
                                        "C fast path of marft_lg's column conversions.", -1, methods};

PyMODINIT_FUNC PyInit__columns_c(void) {
    init_b64();
    return PyModule_Create(&module_def);
}
