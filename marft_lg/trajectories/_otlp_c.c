/* The C fast path of marft_lg's OTLP/JSON reader: one well-formed ExportTraceServiceRequest line -> RawSpans.
 *
 * `spans(line, source)` parses the line in one pass and builds each span's RawSpan directly (no intermediate
 * objects per attribute). It accepts only the usual shape: strict JSON, camelCase OTLP keys, lower-case hex ids,
 * integer times, scalar/array/kvlist attribute values with exactly one key. For anything else it returns None
 * and the caller reads the line with the typed (msgspec) path and then the tolerant path, which decide every
 * quarantine reason. So this file never has to be right about damage, only about good lines, and the tests
 * check that its spans equal the tolerant reader's on good lines and random ones.
 *
 * Attribute keys, trace ids and short attribute strings go through a small direct-mapped cache, so the strings
 * that repeat on every span (keys, agent names, operation names) are allocated once, not once per span.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { OK = 0, REJECT = 1, FAIL = -1 }; /* FAIL: a Python exception is set (out of memory) */

#define MAX_DEPTH 64
#define CACHE_SIZE 4096 /* a power of two */
#define CACHED_VALUE_LEN 48 /* attribute strings up to this long are shared (names, operations, models) */
#define CACHED_KEY_LEN 128  /* attribute keys up to this long are shared and interned */

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
    int depth;
} Parser;

typedef struct {
    PyObject *s;
    uint64_t h;
    Py_ssize_t n;
} CacheEntry;

static CacheEntry cache[CACHE_SIZE];
static PyObject *raw_span_type = NULL;
static PyObject *str_name = NULL, *str_attributes = NULL, *str_empty = NULL;

/* ---------- small helpers ---------- */

static inline void ws(Parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t')) ps->p++;
}

static inline int peek(Parser *ps) {
    ws(ps);
    return ps->p < ps->end ? *ps->p : -1;
}

static inline int eat(Parser *ps, unsigned char c) {
    ws(ps);
    if (ps->p < ps->end && *ps->p == c) {
        ps->p++;
        return 1;
    }
    return 0;
}

/* After a member or element: 1 when another follows (a ',' was eaten), 0 at the closing `close`, -1 otherwise. */
static inline int next_member(Parser *ps, unsigned char close) {
    ws(ps);
    if (ps->p >= ps->end) return -1;
    if (*ps->p == ',') {
        ps->p++;
        return 1;
    }
    if (*ps->p == close) {
        ps->p++;
        return 0;
    }
    return -1;
}

static inline int key_is(const unsigned char *k, Py_ssize_t n, const char *name) {
    return (Py_ssize_t)strlen(name) == n && memcmp(k, name, (size_t)n) == 0;
}

/* A 64-bit hash of a short string, eight bytes at a time. */
static inline uint64_t hash_bytes(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ULL, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

static PyObject *new_ascii(const unsigned char *p, Py_ssize_t n) {
    PyObject *s = PyUnicode_New(n, 127);
    if (s != NULL) memcpy(PyUnicode_1BYTE_DATA(s), p, (size_t)n);
    return s;
}

/* A str of these ASCII bytes, shared with earlier equal ones while they stay in the cache. */
static PyObject *cached_ascii(const unsigned char *p, Py_ssize_t n, int intern) {
    uint64_t h = hash_bytes(p, n);
    CacheEntry *e = &cache[h & (CACHE_SIZE - 1)];
    if (e->s != NULL && e->h == h && e->n == n && memcmp(PyUnicode_1BYTE_DATA(e->s), p, (size_t)n) == 0) {
        Py_INCREF(e->s);
        return e->s;
    }
    PyObject *s = new_ascii(p, n);
    if (s == NULL) return NULL;
    if (intern) PyUnicode_InternInPlace(&s);
    if (PyUnicode_IS_COMPACT_ASCII(s)) {
        Py_XDECREF(e->s);
        Py_INCREF(s);
        e->s = s;
        e->h = h;
        e->n = n;
    }
    return s;
}

static inline int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* ---------- strings ---------- */

#define ONES 0x0101010101010101ULL
/* Nonzero when a byte of `w` is zero / below `n` (n <= 128); exact as a yes-or-no answer. */
static inline uint64_t has_zero(uint64_t w) { return (w - ONES) & ~w & (ONES * 0x80); }
static inline uint64_t has_less(uint64_t w, uint64_t n) { return (w - ONES * n) & ~w & (ONES * 0x80); }

/* Scan a JSON string at ps->p (the opening quote); sets [*s, *s + *n) to its raw body and *flags
 * (1: escapes, 2: non-ASCII bytes). Control characters and a missing closing quote reject. */
static int scan_string(Parser *ps, const unsigned char **s, Py_ssize_t *n, int *flags) {
    ws(ps);
    if (ps->p >= ps->end || *ps->p != '"') return REJECT;
    const unsigned char *p = ++ps->p, *end = ps->end;
    int f = 0;
    for (;;) {
        /* skip plain ASCII bytes (no quote, backslash, control character, non-ASCII) many at a time */
#if defined(__SSE2__)
        while (end - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            __m128i special = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                                                         _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                                           _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));  /* signed: also >= 0x80 */
            int mask = _mm_movemask_epi8(special);
            if (mask) {
                p += __builtin_ctz((unsigned)mask);
                break;
            }
            p += 16;
        }
#endif
        while (end - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            if (has_zero(w ^ (ONES * '"')) | has_zero(w ^ (ONES * '\\')) | has_less(w, 0x20) | (w & (ONES * 0x80)))
                break;
            p += 8;
        }
        if (p >= end) return REJECT;
        unsigned char c = *p;
        if (c == '"') break;
        if (c == '\\') {
            f |= 1;
            p += 2;
            continue;
        }
        if (c < 0x20) return REJECT;
        if (c >= 0x80) f |= 2;
        p++;
    }
    *s = ps->p;
    *n = p - ps->p;
    *flags = f;
    ps->p = p + 1;
    return OK;
}

static inline void put_utf8(unsigned char **o, uint32_t cp) {
    unsigned char *q = *o;
    if (cp < 0x80) {
        *q++ = (unsigned char)cp;
    } else if (cp < 0x800) {
        *q++ = (unsigned char)(0xC0 | (cp >> 6));
        *q++ = (unsigned char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *q++ = (unsigned char)(0xE0 | (cp >> 12));
        *q++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        *q++ = (unsigned char)(0x80 | (cp & 0x3F));
    } else {
        *q++ = (unsigned char)(0xF0 | (cp >> 18));
        *q++ = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        *q++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        *q++ = (unsigned char)(0x80 | (cp & 0x3F));
    }
    *o = q;
}

static int read_u4(const unsigned char *p, const unsigned char *end, uint32_t *cp) {
    if (end - p < 4) return REJECT;
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(p[i]);
        if (h < 0) return REJECT;
        v = (v << 4) | (uint32_t)h;
    }
    *cp = v;
    return OK;
}

/* The UTF-8 text of an escaped body in `buf` (at least n bytes: unescaping never grows it); lone surrogates
 * and unknown escapes reject. */
static int unescape(const unsigned char *p, Py_ssize_t n, unsigned char *buf, Py_ssize_t *out_n) {
    const unsigned char *end = p + n;
    unsigned char *o = buf;
    while (p < end) {
        unsigned char c = *p++;
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        if (p >= end) return REJECT;
        c = *p++;
        switch (c) {
            case '"': *o++ = '"'; break;
            case '\\': *o++ = '\\'; break;
            case '/': *o++ = '/'; break;
            case 'b': *o++ = '\b'; break;
            case 'f': *o++ = '\f'; break;
            case 'n': *o++ = '\n'; break;
            case 'r': *o++ = '\r'; break;
            case 't': *o++ = '\t'; break;
            case 'u': {
                uint32_t cp;
                if (read_u4(p, end, &cp) != OK) return REJECT;
                p += 4;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return REJECT;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    uint32_t lo;
                    if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || read_u4(p + 2, end, &lo) != OK) return REJECT;
                    if (lo < 0xDC00 || lo > 0xDFFF) return REJECT;
                    p += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                put_utf8(&o, cp);
                break;
            }
            default: return REJECT;
        }
    }
    *out_n = o - buf;
    return OK;
}

static int decode_utf8(const unsigned char *p, Py_ssize_t n, PyObject **out) {
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, NULL);
    if (s == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return REJECT;
        }
        return FAIL;
    }
    *out = s;
    return OK;
}

/* An escaped string body, checked and (when `out` is given) decoded into a str. */
static int unescaped(const unsigned char *s, Py_ssize_t n, PyObject **out) {
    unsigned char small[256];
    unsigned char *buf = n <= (Py_ssize_t)sizeof(small) ? small : PyMem_Malloc((size_t)n);
    if (buf == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    Py_ssize_t m;
    int r = unescape(s, n, buf, &m);
    if (r == OK && out != NULL) r = decode_utf8(buf, m, out);
    if (buf != small) PyMem_Free(buf);
    return r;
}

/* A JSON string value as a str; ASCII ones up to `cached` bytes are shared (`intern`: and interned). */
static int parse_string(Parser *ps, PyObject **out, Py_ssize_t cached, int intern) {
    const unsigned char *s;
    Py_ssize_t n;
    int flags;
    int r = scan_string(ps, &s, &n, &flags);
    if (r != OK) return r;
    if (flags == 0) {
        *out = n <= cached ? cached_ascii(s, n, intern) : new_ascii(s, n);
        return *out == NULL ? FAIL : OK;
    }
    if (flags == 2) return decode_utf8(s, n, out);
    return unescaped(s, n, out);
}

/* ---------- numbers and skipped values ---------- */

/* A JSON number at ps->p; *is_int when it has neither fraction nor exponent, *digits counts its integer digits. */
static int scan_number(Parser *ps, const unsigned char **s, Py_ssize_t *n, int *is_int, int *digits) {
    ws(ps);
    const unsigned char *p = ps->p, *end = ps->end, *start = p;
    int integral = 1, d = 0;
    if (p < end && *p == '-') p++;
    if (p >= end) return REJECT;
    if (*p == '0') {
        p++;
        d = 1;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            p++;
            d++;
        }
    } else {
        return REJECT;
    }
    if (p < end && *p == '.') {
        integral = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return REJECT;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        integral = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return REJECT;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    *s = start;
    *n = p - start;
    *is_int = integral;
    *digits = d;
    ps->p = p;
    return OK;
}

/* Digits (an optional leading '-' when `sign`) of at most 18 digits -> int; anything else rejects. */
static int small_int(const unsigned char *s, Py_ssize_t n, int sign, PyObject **out) {
    int neg = 0;
    if (sign && n > 0 && *s == '-') {
        neg = 1;
        s++;
        n--;
    }
    if (n < 1 || n > 18) return REJECT;
    long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return REJECT;
        v = v * 10 + (s[i] - '0');
    }
    *out = PyLong_FromLongLong(neg ? -v : v);
    return *out == NULL ? FAIL : OK;
}

/* The double a JSON number's text stands for; rejects the ones that overflow (orjson refuses those). */
static int number_value(const unsigned char *s, Py_ssize_t n, double *out) {
    char buf[48];
    if (n >= (Py_ssize_t)sizeof(buf)) return REJECT;
    memcpy(buf, s, (size_t)n);
    buf[n] = '\0';
    double d = PyOS_string_to_double(buf, NULL, NULL);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return REJECT;
    }
    if (!isfinite(d)) return REJECT;
    *out = d;
    return OK;
}

static int literal(Parser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return REJECT;
    ps->p += n;
    return OK;
}

/* Check and skip any JSON value (fields the reader does not use). Integers of many digits, numbers that
 * overflow and non-ASCII strings reject: the other decoders may read or refuse those differently. */
static int skip_value(Parser *ps) {
    int c = peek(ps), r;
    if (c == '"') {
        const unsigned char *s;
        Py_ssize_t n;
        int flags;
        r = scan_string(ps, &s, &n, &flags);
        if (r != OK || flags & 2) return REJECT;
        if (flags & 1) r = unescaped(s, n, NULL);
        return r;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        const unsigned char *s;
        Py_ssize_t n;
        int is_int, digits;
        r = scan_number(ps, &s, &n, &is_int, &digits);
        if (r != OK) return r;
        double d;
        return is_int ? (digits > 18 ? REJECT : OK) : number_value(s, n, &d);
    }
    if (c == 't') return literal(ps, "true");
    if (c == 'f') return literal(ps, "false");
    if (c == 'n') return literal(ps, "null");
    if (c != '{' && c != '[') return REJECT;
    if (++ps->depth > MAX_DEPTH) return REJECT;
    ps->p++;
    unsigned char close = c == '{' ? '}' : ']';
    if (eat(ps, close)) {
        ps->depth--;
        return OK;
    }
    for (;;) {
        if (c == '{') {
            const unsigned char *k;
            Py_ssize_t kn;
            int kflags;
            r = scan_string(ps, &k, &kn, &kflags);
            if (r != OK) return r;
            if (kflags) return REJECT;
            if (!eat(ps, ':')) return REJECT;
        }
        r = skip_value(ps);
        if (r != OK) return r;
        int more = next_member(ps, close);
        if (more < 0) return REJECT;
        if (!more) break;
    }
    ps->depth--;
    return OK;
}

/* An object key (no escapes, ASCII) and the ':' after it. */
static int object_key(Parser *ps, const unsigned char **k, Py_ssize_t *n) {
    int flags;
    int r = scan_string(ps, k, n, &flags);
    if (r != OK) return r;
    if (flags || !eat(ps, ':')) return REJECT;
    return OK;
}

/* The key `quoted` (with its quotes and colon, as compact JSON writes it) at ps->p: eaten, 1; else 0. */
static inline int try_key(Parser *ps, const char *quoted, size_t n) {
    if ((size_t)(ps->end - ps->p) >= n && memcmp(ps->p, quoted, n) == 0) {
        ps->p += n;
        return 1;
    }
    return 0;
}

/* `[item, ...]` (or `null` when `nullable`): `item(ps, ctx)` parses each element. */
static int each_item(Parser *ps, int nullable, int (*item)(Parser *, void *), void *ctx) {
    if (nullable && peek(ps) == 'n') return literal(ps, "null");
    if (!eat(ps, '[')) return REJECT;
    if (eat(ps, ']')) return OK;
    for (;;) {
        int r = item(ps, ctx);
        if (r != OK) return r;
        int more = next_member(ps, ']');
        if (more < 0) return REJECT;
        if (!more) return OK;
    }
}

/* ---------- attribute values ---------- */

static int kv_list(Parser *ps, PyObject *dict);

/* `{"values": [...]}` (or `{}`) of an arrayValue (`kv` 0: a list) or kvlistValue (`kv` 1: a dict). */
static int any_value(Parser *ps, PyObject **out);

/* One AnyValue appended to the list `ctx`. */
static int list_item(Parser *ps, void *ctx) {
    PyObject *item = NULL;
    int r = any_value(ps, &item);
    if (r != OK) return r;
    r = PyList_Append((PyObject *)ctx, item) < 0 ? FAIL : OK;
    Py_DECREF(item);
    return r;
}

static int values_of(Parser *ps, int kv, PyObject **out) {
    if (!eat(ps, '{')) return REJECT;
    PyObject *v = kv ? PyDict_New() : PyList_New(0);
    if (v == NULL) return FAIL;
    int r = OK;
    if (!eat(ps, '}')) {
        const unsigned char *k;
        Py_ssize_t kn;
        r = object_key(ps, &k, &kn);
        if (r == OK && !key_is(k, kn, "values")) r = REJECT;
        if (r == OK) {
            if (kv) {
                r = kv_list(ps, v);
            } else {
                r = each_item(ps, 0, list_item, v);
            }
        }
        if (r == OK && !eat(ps, '}')) r = REJECT;
    }
    if (r != OK) {
        Py_DECREF(v);
        return r;
    }
    *out = v;
    return OK;
}

/* An OTLP AnyValue with exactly one key -> its Python value (as `otlp.any_value` reads it). */
static int any_value(Parser *ps, PyObject **out) {
    if (++ps->depth > MAX_DEPTH) return REJECT;
    if (!eat(ps, '{')) return REJECT;
    const unsigned char *k = (const unsigned char *)"stringValue";
    Py_ssize_t kn = 11;
    int r = try_key(ps, "\"stringValue\":", 14) ? OK : object_key(ps, &k, &kn);
    if (r != OK) return r;
    PyObject *v = NULL;
    if (key_is(k, kn, "stringValue")) {
        r = parse_string(ps, &v, CACHED_VALUE_LEN, 0);
    } else if (key_is(k, kn, "intValue")) {
        int c = peek(ps);
        const unsigned char *s;
        Py_ssize_t n;
        if (c == '"') {  /* OTLP/JSON writes 64-bit integers as strings */
            int flags;
            r = scan_string(ps, &s, &n, &flags);
            if (r == OK) r = flags ? REJECT : small_int(s, n, 1, &v);
        } else {
            int is_int, digits;
            r = scan_number(ps, &s, &n, &is_int, &digits);
            if (r == OK) r = is_int ? small_int(s, n, 1, &v) : REJECT;
        }
    } else if (key_is(k, kn, "doubleValue")) {
        const unsigned char *s;
        Py_ssize_t n;
        int is_int, digits;
        r = scan_number(ps, &s, &n, &is_int, &digits);
        double d;
        if (r == OK) r = number_value(s, n, &d);
        if (r == OK && (v = PyFloat_FromDouble(d)) == NULL) r = FAIL;
    } else if (key_is(k, kn, "boolValue")) {
        int c = peek(ps);
        r = literal(ps, c == 't' ? "true" : "false");
        if (r == OK) {
            v = c == 't' ? Py_True : Py_False;
            Py_INCREF(v);
        }
    } else if (key_is(k, kn, "arrayValue")) {
        r = values_of(ps, 0, &v);
    } else if (key_is(k, kn, "kvlistValue")) {
        r = values_of(ps, 1, &v);
    } else if (key_is(k, kn, "bytesValue")) {
        r = parse_string(ps, &v, 0, 0);
    } else {
        r = REJECT;
    }
    if (r == OK && !eat(ps, '}')) r = REJECT;  /* a second key: the other decoders apply a precedence */
    if (r != OK) {
        Py_XDECREF(v);
        return r;
    }
    ps->depth--;
    *out = v;
    return OK;
}

/* One `{"key": ..., "value": ...}` into the dict `ctx` (a later key overwrites an earlier one). */
static int kv_entry(Parser *ps, void *ctx) {
    if (!eat(ps, '{')) return REJECT;
    PyObject *key = NULL, *value = NULL;
    int r = OK;
    for (;;) {
        const unsigned char *k = (const unsigned char *)"key";
        Py_ssize_t kn = 3;
        if (try_key(ps, "\"value\":", 8)) {
            k = (const unsigned char *)"value";
            kn = 5;
        } else if (!try_key(ps, "\"key\":", 6)) {
            r = object_key(ps, &k, &kn);
            if (r != OK) break;
        }
        if (key_is(k, kn, "key") && key == NULL) {
            r = parse_string(ps, &key, CACHED_KEY_LEN, 1);
        } else if (key_is(k, kn, "value") && value == NULL) {
            r = any_value(ps, &value);
        } else {
            r = REJECT;
        }
        if (r != OK) break;
        int more = next_member(ps, '}');
        if (more < 0) r = REJECT;
        if (more <= 0) break;
    }
    if (r == OK && (key == NULL || value == NULL)) r = REJECT;
    if (r == OK && PyDict_SetItem((PyObject *)ctx, key, value) < 0) r = FAIL;
    Py_XDECREF(key);
    Py_XDECREF(value);
    return r;
}

/* `[{"key": ..., "value": ...}, ...]` (or null) into `dict`. */
static int kv_list(Parser *ps, PyObject *dict) { return each_item(ps, 1, kv_entry, dict); }

/* ---------- spans ---------- */

/* A string of exactly `len` lower-case hex digits (ids); *zero when they are all '0'. */
static int hex_id(Parser *ps, Py_ssize_t len, const unsigned char **s, int *zero) {
    Py_ssize_t n;
    int flags;
    int r = scan_string(ps, s, &n, &flags);
    if (r != OK) return r;
    if (flags || n != len) return REJECT;
    int z = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (*s)[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return REJECT;
        if (c != '0') z = 0;
    }
    *zero = z;
    return OK;
}

/* A time: up to 19 digits, as a string (how OTLP/JSON writes 64-bit integers) or a JSON integer, as an int. */
static int span_time(Parser *ps, PyObject **out) {
    const unsigned char *s;
    Py_ssize_t n;
    int r;
    if (peek(ps) == '"') {
        int flags;
        r = scan_string(ps, &s, &n, &flags);
        if (r == OK && flags) r = REJECT;
    } else {
        int is_int, digits;
        r = scan_number(ps, &s, &n, &is_int, &digits);
        if (r == OK && !is_int) r = REJECT;
    }
    if (r != OK) return r;
    if (n < 1 || n > 19) return REJECT;
    unsigned long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return REJECT;
        v = v * 10 + (unsigned long long)(s[i] - '0');
    }
    *out = PyLong_FromUnsignedLongLong(v);
    return *out == NULL ? FAIL : OK;
}

typedef struct {
    PyObject *trace_id, *span_id, *parent, *name, *start, *end, *attributes, *error, *message, *events;
} SpanFields;

static void clear_fields(SpanFields *f) {
    Py_CLEAR(f->trace_id);
    Py_CLEAR(f->span_id);
    Py_CLEAR(f->parent);
    Py_CLEAR(f->name);
    Py_CLEAR(f->start);
    Py_CLEAR(f->end);
    Py_CLEAR(f->attributes);
    Py_CLEAR(f->error);
    Py_CLEAR(f->message);
    Py_CLEAR(f->events);
}

static int status_of(Parser *ps, SpanFields *f) {
    if (peek(ps) == 'n') return literal(ps, "null");
    if (!eat(ps, '{')) return REJECT;
    if (eat(ps, '}')) return OK;
    int seen_code = 0, seen_message = 0;
    for (;;) {
        const unsigned char *k;
        Py_ssize_t kn;
        int r = object_key(ps, &k, &kn);
        if (r != OK) return r;
        if (key_is(k, kn, "code") && !seen_code) {
            seen_code = 1;
            int c = peek(ps);
            if (c == '"') {
                PyObject *code = NULL;
                r = parse_string(ps, &code, CACHED_VALUE_LEN, 0);
                if (r != OK) return r;
                int is_error = PyUnicode_CompareWithASCIIString(code, "2") == 0 ||
                               PyUnicode_CompareWithASCIIString(code, "STATUS_CODE_ERROR") == 0 ||
                               PyUnicode_CompareWithASCIIString(code, "ERROR") == 0;
                Py_DECREF(code);
                if (is_error) Py_SETREF(f->error, Py_NewRef(Py_True));
            } else {
                const unsigned char *s;
                Py_ssize_t n;
                int is_int, digits;
                r = scan_number(ps, &s, &n, &is_int, &digits);
                if (r != OK) return r;
                if (!is_int || digits > 18) return REJECT;
                if (n == 1 && *s == '2') Py_SETREF(f->error, Py_NewRef(Py_True));
            }
        } else if (key_is(k, kn, "message") && !seen_message) {
            seen_message = 1;
            PyObject *m = NULL;
            r = parse_string(ps, &m, 0, 0);
            if (r != OK) return r;
            Py_SETREF(f->message, m);
        } else {
            return REJECT;
        }
        int more = next_member(ps, '}');
        if (more < 0) return REJECT;
        if (!more) return OK;
    }
}

/* One event -> {"name": ..., "attributes": {...}}, appended to f->events. */
static int event_of(Parser *ps, SpanFields *f) {
    if (!eat(ps, '{')) return REJECT;
    PyObject *name = Py_NewRef(Py_None), *attrs = PyDict_New();
    if (attrs == NULL) {
        Py_DECREF(name);
        return FAIL;
    }
    int r = OK, seen = 0;
    if (!eat(ps, '}')) {
        for (;;) {
            const unsigned char *k;
            Py_ssize_t kn;
            r = object_key(ps, &k, &kn);
            if (r != OK) break;
            if (key_is(k, kn, "name") && !(seen & 1)) {
                seen |= 1;
                if (peek(ps) == 'n') {
                    r = literal(ps, "null");
                } else {
                    PyObject *s = NULL;
                    r = parse_string(ps, &s, CACHED_VALUE_LEN, 0);
                    if (r == OK) Py_SETREF(name, s);
                }
            } else if (key_is(k, kn, "attributes") && !(seen & 2)) {
                seen |= 2;
                r = kv_list(ps, attrs);
            } else if ((key_is(k, kn, "timeUnixNano") && !(seen & 4)) ||
                       (key_is(k, kn, "droppedAttributesCount") && !(seen & 8))) {
                seen |= key_is(k, kn, "timeUnixNano") ? 4 : 8;
                r = skip_value(ps);
            } else {
                r = REJECT;
            }
            if (r != OK) break;
            int more = next_member(ps, '}');
            if (more < 0) r = REJECT;
            if (more <= 0) break;
        }
    }
    PyObject *event = NULL;
    if (r == OK) {
        event = PyDict_New();
        if (event == NULL || PyDict_SetItem(event, str_name, name) < 0 ||
            PyDict_SetItem(event, str_attributes, attrs) < 0 || PyList_Append(f->events, event) < 0)
            r = FAIL;
    }
    Py_XDECREF(event);
    Py_DECREF(name);
    Py_DECREF(attrs);
    return r;
}

static int event_item(Parser *ps, void *f) { return event_of(ps, (SpanFields *)f); }

static int events_of(Parser *ps, SpanFields *f) { return each_item(ps, 1, event_item, f); }

enum {
    F_TRACE = 1 << 0, F_SPAN = 1 << 1, F_PARENT = 1 << 2, F_START = 1 << 3, F_END = 1 << 4, F_NAME = 1 << 5,
    F_ATTRS = 1 << 6, F_STATUS = 1 << 7, F_EVENTS = 1 << 8
};

static const char *const SKIPPED_SPAN_KEYS[] = {
    "kind", "traceState", "flags", "links", "droppedAttributesCount", "droppedEventsCount", "droppedLinksCount", NULL};

static int span_of(Parser *ps, PyObject *source, PyObject *out) {
    if (!eat(ps, '{')) return REJECT;
    SpanFields f = {0};
    f.attributes = PyDict_New();
    f.events = PyList_New(0);
    f.error = Py_NewRef(Py_False);
    f.message = Py_NewRef(str_empty);
    f.name = Py_NewRef(str_empty);
    f.parent = Py_NewRef(Py_None);
    if (f.attributes == NULL || f.events == NULL) {
        clear_fields(&f);
        return FAIL;
    }
    int r = OK;
    unsigned seen = 0, skipped = 0;
    if (eat(ps, '}')) r = REJECT;
    while (r == OK) {
        const unsigned char *k, *s;
        Py_ssize_t kn;
        int zero;
        r = object_key(ps, &k, &kn);
        if (r != OK) break;
        unsigned bit = 0;
        if (key_is(k, kn, "traceId")) {
            bit = F_TRACE;
            r = hex_id(ps, 32, &s, &zero);
            if (r == OK && zero) r = REJECT;
            if (r == OK && (seen & bit) == 0 && (f.trace_id = cached_ascii(s, 32, 0)) == NULL) r = FAIL;
        } else if (key_is(k, kn, "spanId")) {
            bit = F_SPAN;
            r = hex_id(ps, 16, &s, &zero);
            if (r == OK && zero) r = REJECT;
            if (r == OK && (seen & bit) == 0 && (f.span_id = new_ascii(s, 16)) == NULL) r = FAIL;
        } else if (key_is(k, kn, "parentSpanId")) {
            bit = F_PARENT;
            if (peek(ps) == '"' && ps->p + 1 < ps->end && ps->p[1] == '"') {
                ps->p += 2;  /* "": a root span */
            } else {
                r = hex_id(ps, 16, &s, &zero);
                if (r == OK && !zero && (seen & bit) == 0) {
                    PyObject *parent = new_ascii(s, 16);
                    if (parent == NULL) r = FAIL;
                    else Py_SETREF(f.parent, parent);
                }
            }
        } else if (key_is(k, kn, "startTimeUnixNano")) {
            bit = F_START;
            if ((seen & bit) == 0) r = span_time(ps, &f.start);
        } else if (key_is(k, kn, "endTimeUnixNano")) {
            bit = F_END;
            if ((seen & bit) == 0) r = span_time(ps, &f.end);
        } else if (key_is(k, kn, "name")) {
            bit = F_NAME;
            if (peek(ps) == 'n') {
                r = literal(ps, "null");
            } else if ((seen & bit) == 0) {
                PyObject *name = NULL;
                r = parse_string(ps, &name, CACHED_KEY_LEN, 1);
                if (r == OK) Py_SETREF(f.name, name);
            }
        } else if (key_is(k, kn, "attributes")) {
            bit = F_ATTRS;
            if ((seen & bit) == 0) r = kv_list(ps, f.attributes);
        } else if (key_is(k, kn, "status")) {
            bit = F_STATUS;
            if ((seen & bit) == 0) r = status_of(ps, &f);
        } else if (key_is(k, kn, "events")) {
            bit = F_EVENTS;
            if ((seen & bit) == 0) r = events_of(ps, &f);
        } else {
            int i = 0;
            while (SKIPPED_SPAN_KEYS[i] != NULL && !key_is(k, kn, SKIPPED_SPAN_KEYS[i])) i++;
            if (SKIPPED_SPAN_KEYS[i] == NULL || (skipped & (1u << i))) {
                r = REJECT;
            } else {
                skipped |= 1u << i;
                r = skip_value(ps);
            }
        }
        if (r != OK) break;
        if (seen & bit) {  /* a field twice: the other decoders decide which one counts */
            r = REJECT;
            break;
        }
        seen |= bit;
        int more = next_member(ps, '}');
        if (more < 0) r = REJECT;
        if (more <= 0) break;
    }
    /* parentSpanId may be absent (a root span, as collectors write it); the rest is required */
    if (r == OK && (seen & (F_TRACE | F_SPAN | F_START | F_END)) != (F_TRACE | F_SPAN | F_START | F_END)) r = REJECT;
    if (r == OK) {
        int lt = PyObject_RichCompareBool(f.end, f.start, Py_LT);
        if (lt < 0) r = FAIL;
        else if (lt) r = REJECT;
    }
    if (r == OK) {
        PyObject *args[11] = {f.trace_id, f.span_id, f.parent, f.name, f.start, f.end,
                              f.attributes, f.error, f.message, f.events, source};
        PyObject *span = PyObject_Vectorcall(raw_span_type, args, 11, NULL);
        if (span == NULL || PyList_Append(out, span) < 0) r = FAIL;
        Py_XDECREF(span);
    }
    clear_fields(&f);
    return r;
}

typedef struct {
    PyObject *source, *out;
} SpanSink;

static int span_item(Parser *ps, void *sink) {
    return span_of(ps, ((SpanSink *)sink)->source, ((SpanSink *)sink)->out);
}

/* `[span, ...]` of one scopeSpans entry. */
static int span_list(Parser *ps, PyObject *source, PyObject *out) {
    SpanSink sink = {source, out};
    return each_item(ps, 0, span_item, &sink);
}

/* `[{...}, ...]` entries with one required list key (`inner`, parsed by `parse_inner`) and optional skipped keys. */
static int entries(Parser *ps, const char *inner, const char *skip1, const char *skip2,
                   int (*parse_inner)(Parser *, PyObject *, PyObject *), PyObject *source, PyObject *out) {
    if (!eat(ps, '[')) return REJECT;
    if (eat(ps, ']')) return OK;
    for (;;) {
        if (!eat(ps, '{')) return REJECT;
        int seen = 0, r = OK;
        if (eat(ps, '}')) return REJECT;
        for (;;) {
            const unsigned char *k;
            Py_ssize_t kn;
            r = object_key(ps, &k, &kn);
            if (r != OK) return r;
            int bit = key_is(k, kn, inner) ? 1 : key_is(k, kn, skip1) ? 2 : key_is(k, kn, skip2) ? 4 : 0;
            if (bit == 0 || (seen & bit)) return REJECT;
            seen |= bit;
            r = bit == 1 ? parse_inner(ps, source, out) : skip_value(ps);
            if (r != OK) return r;
            int more = next_member(ps, '}');
            if (more < 0) return REJECT;
            if (!more) break;
        }
        if (!(seen & 1)) return REJECT;
        int more = next_member(ps, ']');
        if (more < 0) return REJECT;
        if (!more) return OK;
    }
}

static int scope_spans(Parser *ps, PyObject *source, PyObject *out) {
    return entries(ps, "spans", "scope", "schemaUrl", span_list, source, out);
}

static PyObject *spans(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "spans(line: bytes, source: str)");
        return NULL;
    }
    if (raw_span_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "call configure(RawSpan) first");
        return NULL;
    }
    Parser ps = {(const unsigned char *)PyBytes_AS_STRING(args[0]),
                 (const unsigned char *)PyBytes_AS_STRING(args[0]) + PyBytes_GET_SIZE(args[0]), 0};
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    int r = OK;
    if (!eat(&ps, '{')) r = REJECT;
    if (r == OK) {
        const unsigned char *k;
        Py_ssize_t kn;
        r = object_key(&ps, &k, &kn);
        if (r == OK && !key_is(k, kn, "resourceSpans")) r = REJECT;
    }
    if (r == OK) r = entries(&ps, "scopeSpans", "resource", "schemaUrl", scope_spans, args[1], out);
    if (r == OK && !eat(&ps, '}')) r = REJECT;
    if (r == OK) {
        ws(&ps);
        if (ps.p != ps.end) r = REJECT;
    }
    if (r == FAIL) {
        Py_DECREF(out);
        return NULL;
    }
    if (r == REJECT) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    PyObject *result = Py_BuildValue("(Nn)", out, PyList_GET_SIZE(out));
    return result;
}

/* ---------- own-format spans -> SpanInfo ----------
 * `own_usual(raw, attrs, op)` is `formats/own._parse_usual` (the usual own span: no error, no feedback, a string
 * operation) in C: the same lookups, conversions and interning, the rarer conversions through the same Python
 * helpers, and the SpanInfo's slots filled directly instead of through the dataclass's Python __init__. The
 * attribute keys, helpers and constants come from Python (`configure_own`), so the names live in one place. */

enum {
    K_EPISODE_ID, K_SCENARIO_ID, K_ROLE, K_NODE, K_STEP, K_TRIGGERS, K_TASK_ID, K_CHECKPOINT_NS, K_CONVERSATION,
    K_AGENT_NAME, K_INPUT_MESSAGES, K_SYSTEM_INSTRUCTIONS, K_OUTPUT_MESSAGES, K_INPUT_TOKENS, K_PROMPT_TOKENS,
    K_OUTPUT_TOKENS, K_COMPLETION_TOKENS, K_RESPONSE_MODEL, K_REQUEST_MODEL, K_PROMPT_TOKEN_IDS,
    K_COMPLETION_TOKEN_IDS, K_COMPLETION_LOGPROBS, K_ADAPTER_VERSION, K_LATENCY_S, K_TOOL_CALLS, K_TOOL_NAME,
    K_TOOL_CALL_ID, K_TOOL_ARGS, K_TOOL_RESULT, K_OUTCOME, K_EPISODE_METADATA, N_KEYS
};
enum { H_AS_INT, H_AS_LIST, H_JSON_OR, H_INPUT_MESSAGES, H_OUTPUT_MESSAGE, N_HELPERS };
enum { C_FMT, C_LLM, C_TOOL, C_AGENT, C_WORKFLOW, C_OTHER, C_OP_TOOL, C_AGENT_OPS, C_OP_WORKFLOW, C_LLM_OPS,
       C_UNKNOWN, N_CONSTANTS };
enum {
    S_TRACE_ID, S_SPAN_ID, S_PARENT_ID, S_NAME, S_START_NS, S_END_NS, S_SOURCE, S_FMT, S_KIND, S_ERROR,
    S_ERROR_MESSAGE, S_AGENT, S_EPISODE_ID, S_SESSION, S_SCENARIO_ID, S_STEP, S_TRIGGERS, S_TASK, S_MESSAGES,
    S_COMPLETION, S_TOOL_CALLS, S_PROMPT_TOKEN_IDS, S_COMPLETION_TOKEN_IDS, S_COMPLETION_LOGPROBS, S_INPUT_TOKENS,
    S_OUTPUT_TOKENS, S_LATENCY_S, S_MODEL, S_ADAPTER_VERSION, S_TOOL_NAME, S_TOOL_ARGS, S_TOOL_RESULT,
    S_TOOL_CALL_ID, S_OUTCOME, S_METADATA, S_RAW_IO, N_SET
};
static const char *const SET_NAMES[N_SET] = {
    "trace_id", "span_id", "parent_id", "name", "start_ns", "end_ns", "source", "fmt", "kind", "error",
    "error_message", "agent", "episode_id", "session", "scenario_id", "step", "triggers", "task", "messages",
    "completion", "tool_calls", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "input_tokens",
    "output_tokens", "latency_s", "model", "adapter_version", "tool_name", "tool_args", "tool_result",
    "tool_call_id", "outcome", "metadata", "raw_io"};
enum { R_TRACE_ID, R_SPAN_ID, R_PARENT_ID, R_NAME, R_START_NS, R_END_NS, R_SOURCE, N_RAW };
static const char *const RAW_NAMES[N_RAW] = {"trace_id", "span_id", "parent_id", "name", "start_ns", "end_ns",
                                             "source"};

static PyObject *own_keys[N_KEYS], *own_helpers[N_HELPERS], *own_constants[N_CONSTANTS];
static PyTypeObject *span_info = NULL;
static Py_ssize_t info_offset[N_SET], raw_offset[N_RAW];
static PyObject *info_defaults = NULL;  /* tuple: (offset, default) for every slot of SpanInfo */

/* The offset of a writable object slot `name` of `type` (a __slots__ / msgspec field); -1 with an error set. */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if ((m->type == T_OBJECT_EX || m->type == T_OBJECT) && !(m->flags & READONLY)) off = m->offset;
    }
    Py_DECREF(descr);
    if (off < 0) PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name, name);
    return off;
}

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static void set_slot(PyObject *obj, int field, PyObject *value) {  /* steals `value` */
    PyObject **slot = &SLOT(obj, info_offset[field]);
    Py_XSETREF(*slot, value);
}

/* configure_span_info(SpanInfo, defaults): SpanInfo's slots and defaults, and where the RawSpan type given to
 * `configure` keeps its fields, for the format readers below (formats/base.py). */
static PyObject *configure_span_info(PyObject *module, PyObject *args) {
    PyObject *info_type, *defaults;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &info_type, &PyDict_Type, &defaults)) return NULL;
    if (raw_span_type == NULL || !PyType_Check(raw_span_type)) {
        PyErr_SetString(PyExc_RuntimeError, "call configure(RawSpan) first");
        return NULL;
    }
    PyTypeObject *raw_type = (PyTypeObject *)raw_span_type;
    for (int i = 0; i < N_SET; i++)
        if ((info_offset[i] = slot_offset((PyTypeObject *)info_type, SET_NAMES[i])) < 0) return NULL;
    for (int i = 0; i < N_RAW; i++)
        if ((raw_offset[i] = slot_offset(raw_type, RAW_NAMES[i])) < 0) return NULL;
    PyObject *pairs = PyList_New(0), *name, *value;
    Py_ssize_t pos = 0;
    if (pairs == NULL) return NULL;
    while (PyDict_Next(defaults, &pos, &name, &value)) {  /* every slot: one default each */
        const char *text = PyUnicode_AsUTF8(name);
        Py_ssize_t off = text == NULL ? -1 : slot_offset((PyTypeObject *)info_type, text);
        PyObject *pair = off < 0 ? NULL : Py_BuildValue("(nO)", off, value);
        if (pair == NULL || PyList_Append(pairs, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(pairs);
            return NULL;
        }
        Py_DECREF(pair);
    }
    Py_XSETREF(info_defaults, PyList_AsTuple(pairs));
    Py_DECREF(pairs);
    if (info_defaults == NULL) return NULL;
    Py_XSETREF(span_info, (PyTypeObject *)Py_NewRef(info_type));
    Py_RETURN_NONE;
}

/* Copy a tuple's items into `dest` (`n` of them exactly). */
static int take_items(PyObject *tuple, PyObject **dest, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
        PyErr_Format(PyExc_ValueError, "expected %zd %s", n, what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) Py_XSETREF(dest[i], Py_NewRef(PyTuple_GET_ITEM(tuple, i)));
    return 0;
}

/* configure_own(keys, helpers, constants): see formats/own.py. */
static PyObject *configure_own(PyObject *module, PyObject *args) {
    PyObject *keys, *helpers, *constants;
    if (!PyArg_ParseTuple(args, "OOO", &keys, &helpers, &constants)) return NULL;
    if (take_items(keys, own_keys, N_KEYS, "keys") < 0 || take_items(helpers, own_helpers, N_HELPERS, "helpers") < 0 ||
        take_items(constants, own_constants, N_CONSTANTS, "constants") < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A new SpanInfo with every slot at its default. */
static PyObject *new_span_info(void) {
    PyObject *obj = span_info->tp_alloc(span_info, 0);
    if (obj == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(info_defaults); i++) {
        PyObject *pair = PyTuple_GET_ITEM(info_defaults, i);
        SLOT(obj, PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0))) = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
    }
    return obj;
}

/* A new SpanInfo of `raw`'s span: its ids, times and source, the (interned) `name`, `fmt` and `kind`. */
static PyObject *new_span_of(PyObject *raw, PyObject *name, PyObject *fmt, PyObject *kind) {
    PyObject *info = new_span_info();
    if (info == NULL) return NULL;
    static const int from_raw[][2] = {{S_TRACE_ID, R_TRACE_ID}, {S_SPAN_ID, R_SPAN_ID}, {S_PARENT_ID, R_PARENT_ID},
                                      {S_START_NS, R_START_NS}, {S_END_NS, R_END_NS}, {S_SOURCE, R_SOURCE}};
    for (size_t i = 0; i < sizeof(from_raw) / sizeof(from_raw[0]); i++)
        set_slot(info, from_raw[i][0], Py_NewRef(SLOT(raw, raw_offset[from_raw[i][1]])));
    set_slot(info, S_NAME, Py_NewRef(name));
    set_slot(info, S_FMT, Py_NewRef(fmt));
    set_slot(info, S_KIND, Py_NewRef(kind));
    return info;
}

static inline PyObject *get(PyObject *a, int key) {  /* borrowed; NULL when absent (no error) */
    return PyDict_GetItemWithError(a, own_keys[key]);
}

static inline PyObject *or_none(PyObject *v) { return Py_NewRef(v != NULL ? v : Py_None); }

/* `_str(v)`: None and str as they are, anything else str(v) (a new reference). */
static PyObject *as_str(PyObject *v) {
    if (v == NULL || v == Py_None) return Py_NewRef(Py_None);
    if (PyUnicode_CheckExact(v)) return Py_NewRef(v);
    return PyObject_Str(v);
}

/* `sys.intern(v) if type(v) is str else v`; steals and returns a reference. */
static PyObject *interned(PyObject *v) {
    if (v != NULL && PyUnicode_CheckExact(v)) PyUnicode_InternInPlace(&v);
    return v;
}

/* `x or y`: x when truthy, else y (steals x; y borrowed, None when NULL); NULL on error. */
static PyObject *or_else(PyObject *x, PyObject *y) {
    if (x == NULL) return NULL;
    int t = PyObject_IsTrue(x);
    if (t < 0) {
        Py_DECREF(x);
        return NULL;
    }
    if (t) return x;
    Py_DECREF(x);
    return or_none(y);
}

static PyObject *call1(int helper, PyObject *arg) {
    return PyObject_CallOneArg(own_helpers[helper], arg != NULL ? arg : Py_None);
}

/* `v if type(v) is int else as_int(v)` */
static PyObject *int_or_as_int(PyObject *v) {
    if (v != NULL && PyLong_CheckExact(v)) return Py_NewRef(v);
    return call1(H_AS_INT, v);
}

static PyObject *own_usual(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (span_info == NULL || own_keys[0] == NULL || nargs != 3 || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "own_usual(raw, attrs: dict, op): call configure_span_info and configure_own first");
        return NULL;
    }
    PyObject *raw = args[0], *a = args[1], *op = args[2], *v;
    if (!Py_IS_TYPE(raw, (PyTypeObject *)raw_span_type)) {
        PyErr_SetString(PyExc_TypeError, "own_usual: raw must be a RawSpan");
        return NULL;
    }
    PyObject *info = NULL, *agent = NULL, *kind;
    PyObject *name = interned(Py_NewRef(SLOT(raw, raw_offset[R_NAME])));
    PyObject *episode_id = NULL, *scenario_id = NULL, *step = NULL, *triggers = NULL, *task = NULL, *session = NULL;

    v = get(a, K_EPISODE_ID);
    if (v != NULL && v != Py_None) {
        if ((episode_id = interned(as_str(v))) == NULL) goto fail;
    }
    v = get(a, K_SCENARIO_ID);
    if (v != NULL && v != Py_None) {
        if ((scenario_id = interned(as_str(v))) == NULL) goto fail;
    }
    if ((agent = or_else(as_str(get(a, K_ROLE)), NULL)) == NULL) goto fail;
    if (agent == Py_None) {
        Py_DECREF(agent);
        if ((agent = as_str(get(a, K_NODE))) == NULL) goto fail;
    }
    if ((step = int_or_as_int(get(a, K_STEP))) == NULL) goto fail;
    v = get(a, K_TRIGGERS);
    if (v != NULL && v != Py_None && (triggers = call1(H_AS_LIST, v)) == NULL) goto fail;
    if ((task = or_else(as_str(get(a, K_TASK_ID)), NULL)) == NULL) goto fail;
    if (task == Py_None) {
        Py_DECREF(task);
        if ((task = as_str(get(a, K_CHECKPOINT_NS))) == NULL) goto fail;
    }
    task = interned(task);
    session = interned(or_none(get(a, K_CONVERSATION)));
    if (PyErr_Occurred()) goto fail;

    int is_llm = PySet_Contains(own_constants[C_LLM_OPS], op);
    if (is_llm < 0) goto fail;
    if (is_llm) {
        kind = own_constants[C_LLM];
        if ((agent = or_else(agent, get(a, K_AGENT_NAME))) == NULL) goto fail;
    } else {
        int cmp;
        if ((cmp = PyObject_RichCompareBool(op, own_constants[C_OP_TOOL], Py_EQ)) < 0) goto fail;
        if (cmp) {
            kind = own_constants[C_TOOL];
        } else {
            if ((cmp = PySequence_Contains(own_constants[C_AGENT_OPS], op)) < 0) goto fail;
            if (cmp) {
                kind = own_constants[C_AGENT];
                if ((agent = or_else(agent, get(a, K_AGENT_NAME))) == NULL) goto fail;
                if ((agent = or_else(agent, name)) == NULL) goto fail;
            } else {
                if ((cmp = PyObject_RichCompareBool(op, own_constants[C_OP_WORKFLOW], Py_EQ)) < 0) goto fail;
                kind = own_constants[cmp ? C_WORKFLOW : C_OTHER];
            }
        }
    }
    if (PyErr_Occurred()) goto fail;
    if ((info = new_span_of(raw, name, own_constants[C_FMT], kind)) == NULL) goto fail;
    set_slot(info, S_AGENT, interned(agent));
    agent = NULL;
    set_slot(info, S_EPISODE_ID, or_none(episode_id));
    set_slot(info, S_SESSION, session);
    session = NULL;
    set_slot(info, S_SCENARIO_ID, or_none(scenario_id));
    set_slot(info, S_STEP, step);
    step = NULL;
    set_slot(info, S_TRIGGERS, or_none(triggers));
    set_slot(info, S_TASK, task);
    task = NULL;

    if (kind == own_constants[C_LLM]) {
        int has_in = PyDict_Contains(a, own_keys[K_INPUT_MESSAGES]);
        int has_out = has_in ? 0 : PyDict_Contains(a, own_keys[K_OUTPUT_MESSAGES]);
        if (has_in < 0 || has_out < 0) goto fail;
        if (has_in || has_out) {
            PyObject *in = get(a, K_INPUT_MESSAGES), *system = get(a, K_SYSTEM_INSTRUCTIONS);
            PyObject *out = get(a, K_OUTPUT_MESSAGES);
            PyObject *io = PyTuple_Pack(3, in ? in : Py_None, system ? system : Py_None, out ? out : Py_None);
            if (io == NULL) goto fail;
            set_slot(info, S_RAW_IO, io);
        } else {
            PyObject *messages = call1(H_INPUT_MESSAGES, a), *out;
            if (messages == NULL) goto fail;
            set_slot(info, S_MESSAGES, messages);
            if ((out = call1(H_OUTPUT_MESSAGE, a)) == NULL) goto fail;
            if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 2) {
                Py_DECREF(out);
                PyErr_SetString(PyExc_ValueError, "output_message must return (completion, tool_calls)");
                goto fail;
            }
            set_slot(info, S_COMPLETION, Py_NewRef(PyTuple_GET_ITEM(out, 0)));
            set_slot(info, S_TOOL_CALLS, Py_NewRef(PyTuple_GET_ITEM(out, 1)));
            Py_DECREF(out);
        }
        PyObject *t;  /* `v if type(v) is int else as_int(get(legacy key) if v is missing else v)` */
        v = get(a, K_INPUT_TOKENS);
        t = v != NULL && PyLong_CheckExact(v) ? Py_NewRef(v) : call1(H_AS_INT, v != NULL ? v : get(a, K_PROMPT_TOKENS));
        if (t == NULL) goto fail;
        set_slot(info, S_INPUT_TOKENS, t);
        v = get(a, K_OUTPUT_TOKENS);
        t = v != NULL && PyLong_CheckExact(v) ? Py_NewRef(v)
                                              : call1(H_AS_INT, v != NULL ? v : get(a, K_COMPLETION_TOKENS));
        if (t == NULL) goto fail;
        set_slot(info, S_OUTPUT_TOKENS, t);
        PyObject *model = or_else(or_none(get(a, K_RESPONSE_MODEL)), get(a, K_REQUEST_MODEL));
        if (model == NULL) goto fail;
        if (model != Py_None) {
            int ne = PyObject_RichCompareBool(model, own_constants[C_UNKNOWN], Py_NE);
            if (ne < 0) {
                Py_DECREF(model);
                goto fail;
            }
            if (ne) {
                PyObject *text = PyObject_Str(model);
                if (text == NULL) {
                    Py_DECREF(model);
                    goto fail;
                }
                set_slot(info, S_MODEL, interned(text));
            }
        }
        Py_DECREF(model);
        set_slot(info, S_PROMPT_TOKEN_IDS, or_none(get(a, K_PROMPT_TOKEN_IDS)));
        set_slot(info, S_COMPLETION_TOKEN_IDS, or_none(get(a, K_COMPLETION_TOKEN_IDS)));
        set_slot(info, S_COMPLETION_LOGPROBS, or_none(get(a, K_COMPLETION_LOGPROBS)));
        v = get(a, K_ADAPTER_VERSION);
        if (v != NULL && v != Py_None) {
            PyObject *text = as_str(v);
            if (text == NULL) goto fail;
            set_slot(info, S_ADAPTER_VERSION, interned(text));
        }
        v = get(a, K_LATENCY_S);
        if (v != NULL && (PyLong_Check(v) || PyFloat_Check(v))) {
            PyObject *f = PyNumber_Float(v);
            if (f == NULL) goto fail;
            set_slot(info, S_LATENCY_S, f);
        }
        v = get(a, K_TOOL_CALLS);
        if (v != NULL && v != Py_None) {
            PyObject *calls = call1(H_JSON_OR, v);
            if (calls == NULL) goto fail;
            if (PyList_Check(calls) && PyList_GET_SIZE(calls) > 0) set_slot(info, S_TOOL_CALLS, calls);
            else Py_DECREF(calls);
        }
    } else if (kind == own_constants[C_TOOL]) {
        PyObject *tool_name = or_else(or_none(get(a, K_TOOL_NAME)), name), *args;
        if (tool_name == NULL) goto fail;
        set_slot(info, S_TOOL_NAME, interned(tool_name));
        set_slot(info, S_TOOL_CALL_ID, or_none(get(a, K_TOOL_CALL_ID)));
        if ((args = call1(H_JSON_OR, get(a, K_TOOL_ARGS))) == NULL) goto fail;
        set_slot(info, S_TOOL_ARGS, args);
        set_slot(info, S_TOOL_RESULT, or_none(get(a, K_TOOL_RESULT)));
    }
    if (PyErr_Occurred()) goto fail;
    int has_outcome = PyDict_Contains(a, own_keys[K_OUTCOME]);
    int has_meta = PyDict_Contains(a, own_keys[K_EPISODE_METADATA]);
    if (has_outcome < 0 || has_meta < 0) goto fail;
    if (kind == own_constants[C_WORKFLOW] || has_outcome || has_meta) {
        if (has_outcome) {
            PyObject *outcome = as_str(get(a, K_OUTCOME));
            if (outcome == NULL) goto fail;
            set_slot(info, S_OUTCOME, outcome);
        }
        PyObject *meta = call1(H_JSON_OR, get(a, K_EPISODE_METADATA));
        if (meta == NULL) goto fail;
        if (PyDict_Check(meta)) set_slot(info, S_METADATA, meta);
        else Py_DECREF(meta);
        if (kind != own_constants[C_LLM] && kind != own_constants[C_TOOL] && SLOT(raw, raw_offset[R_PARENT_ID]) == Py_None)
            set_slot(info, S_KIND, Py_NewRef(own_constants[C_WORKFLOW]));
    }
    if (PyErr_Occurred()) goto fail;
    Py_DECREF(name);
    Py_XDECREF(episode_id);
    Py_XDECREF(scenario_id);
    Py_XDECREF(triggers);
    return info;

fail:
    Py_XDECREF(session);
    Py_XDECREF(info);
    Py_XDECREF(name);
    Py_XDECREF(agent);
    Py_XDECREF(episode_id);
    Py_XDECREF(scenario_id);
    Py_XDECREF(step);
    Py_XDECREF(triggers);
    Py_XDECREF(task);
    return NULL;
}

/* ---------- OpenInference spans -> SpanInfo ----------
 * `oi_usual(raw, attrs)` is formats/openinference.parse for a span without error, in C; `_metadata`,
 * `io_messages` and the other conversions stay the Python helpers given to `configure_oi`. */

enum { OK_KIND, OK_METADATA, OK_SESSION, OK_MODEL, OK_PROMPT_TOKENS, OK_COMPLETION_TOKENS, OK_TOOL_NAME,
       OK_TOOL_CALL_ID, OK_TOOL_PARAMETERS, OK_INPUT_VALUE, OK_OUTPUT_VALUE, N_OI_KEYS };
enum { OH_METADATA, OH_IO_MESSAGES, OH_AS_INT, OH_JSON_OR, OH_TOOL_RESULT_TEXT, OH_WORKFLOW_METADATA, N_OI_HELPERS };
enum { OC_FMT, OC_LLM, OC_TOOL, OC_AGENT, OC_WORKFLOW, OC_OTHER, OC_KIND_LLM, OC_KIND_TOOL, OC_KIND_AGENT,
       OC_KIND_CHAIN, OC_CONTENT, OC_TOOL_CALLS, OC_EMPTY, N_OI_CONSTANTS };
static PyObject *oi_keys[N_OI_KEYS], *oi_helpers[N_OI_HELPERS], *oi_constants[N_OI_CONSTANTS];

/* configure_oi(keys, helpers, constants): see formats/openinference.py. */
static PyObject *configure_oi(PyObject *module, PyObject *args) {
    PyObject *keys, *helpers, *constants;
    if (!PyArg_ParseTuple(args, "OOO", &keys, &helpers, &constants)) return NULL;
    if (take_items(keys, oi_keys, N_OI_KEYS, "keys") < 0 || take_items(helpers, oi_helpers, N_OI_HELPERS, "helpers") < 0 ||
        take_items(constants, oi_constants, N_OI_CONSTANTS, "constants") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static inline PyObject *oi_get(PyObject *a, int key) { return PyDict_GetItemWithError(a, oi_keys[key]); }

static PyObject *oi_call(int helper, PyObject *arg) {
    return PyObject_CallOneArg(oi_helpers[helper], arg != NULL ? arg : Py_None);
}

/* `obj.get(key)` for the last output message (a dict nearly always). */
static PyObject *get_item(PyObject *obj, PyObject *key) {
    if (PyDict_CheckExact(obj)) return or_none(PyDict_GetItemWithError(obj, key));
    return PyObject_CallMethod(obj, "get", "O", key);
}

static PyObject *oi_usual(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (span_info == NULL || oi_keys[0] == NULL || nargs != 2 || !PyDict_CheckExact(args[1]) ||
        !Py_IS_TYPE(args[0], (PyTypeObject *)raw_span_type)) {
        PyErr_SetString(PyExc_TypeError, "oi_usual(raw: RawSpan, attrs: dict): call configure_span_info and configure_oi first");
        return NULL;
    }
    PyObject *raw = args[0], *a = args[1], *v;
    PyObject *info = NULL, *kind_text = NULL, *meta = NULL, *session = NULL, *name = NULL, *agent = NULL;
    PyObject *kind, *node, *step, *triggers, *task, *scenario;
    int cmp;

    v = oi_get(a, OK_KIND);
    if (v == NULL && PyErr_Occurred()) goto fail;
    PyObject *text = PyObject_Str(v != NULL ? v : oi_constants[OC_EMPTY]);  /* str(get(kind, "")).upper() */
    if (text == NULL) goto fail;
    kind_text = PyObject_CallMethod(text, "upper", NULL);
    Py_DECREF(text);
    if (kind_text == NULL) goto fail;
    if ((meta = oi_call(OH_METADATA, oi_get(a, OK_METADATA))) == NULL) goto fail;
    if (!PyTuple_Check(meta) || PyTuple_GET_SIZE(meta) != 8) {
        PyErr_SetString(PyExc_ValueError, "_metadata must return 8 fields");
        goto fail;
    }
    /* (meta, node, agent, step, triggers, task, session, scenario), borrowed from `meta` */
    node = PyTuple_GET_ITEM(meta, 1);
    step = PyTuple_GET_ITEM(meta, 3);
    triggers = PyTuple_GET_ITEM(meta, 4);
    task = PyTuple_GET_ITEM(meta, 5);
    scenario = PyTuple_GET_ITEM(meta, 7);
    if ((session = or_else(or_none(oi_get(a, OK_SESSION)), PyTuple_GET_ITEM(meta, 6))) == NULL) goto fail;
    session = interned(session);
    name = interned(Py_NewRef(SLOT(raw, raw_offset[R_NAME])));
    agent = Py_NewRef(PyTuple_GET_ITEM(meta, 2));
    if (PyErr_Occurred()) goto fail;

    int is_llm = PyUnicode_Check(kind_text) && PyUnicode_Compare(kind_text, oi_constants[OC_KIND_LLM]) == 0;
    int is_tool = !is_llm && PyUnicode_Check(kind_text) && PyUnicode_Compare(kind_text, oi_constants[OC_KIND_TOOL]) == 0;
    int is_chain = PyUnicode_Check(kind_text) && PyUnicode_Compare(kind_text, oi_constants[OC_KIND_CHAIN]) == 0;
    if (PyErr_Occurred()) goto fail;
    if (is_llm) {
        kind = oi_constants[OC_LLM];
    } else if (is_tool) {
        kind = oi_constants[OC_TOOL];
    } else {
        int is_agent = PyUnicode_Check(kind_text) && PyUnicode_Compare(kind_text, oi_constants[OC_KIND_AGENT]) == 0;
        if (!is_agent && is_chain) {  /* kind == "CHAIN" and node and name == node */
            int t = PyObject_IsTrue(node);
            if (t < 0) goto fail;
            if (t) {
                if ((cmp = PyObject_RichCompareBool(name, node, Py_EQ)) < 0) goto fail;
                is_agent = cmp;
            }
        }
        if (is_agent) {
            kind = oi_constants[OC_AGENT];
            if ((agent = or_else(agent, name)) == NULL) goto fail;
        } else if (is_chain && SLOT(raw, raw_offset[R_PARENT_ID]) == Py_None) {
            kind = oi_constants[OC_WORKFLOW];
        } else {
            kind = oi_constants[OC_OTHER];
            if (is_chain) {  /* None if kind == "CHAIN" and name != node else agent */
                if ((cmp = PyObject_RichCompareBool(name, node, Py_NE)) < 0) goto fail;
                if (cmp) Py_SETREF(agent, Py_NewRef(Py_None));
            }
        }
    }
    if ((info = new_span_of(raw, name, oi_constants[OC_FMT], kind)) == NULL) goto fail;
    set_slot(info, S_AGENT, agent);
    agent = NULL;
    set_slot(info, S_SESSION, session);
    session = NULL;
    set_slot(info, S_SCENARIO_ID, Py_NewRef(scenario));
    set_slot(info, S_STEP, Py_NewRef(step));
    set_slot(info, S_TRIGGERS, Py_NewRef(triggers));
    set_slot(info, S_TASK, Py_NewRef(task));

    if (kind == oi_constants[OC_LLM]) {
        PyObject *io = oi_call(OH_IO_MESSAGES, a), *t;
        if (io == NULL) goto fail;
        if (!PyTuple_Check(io) || PyTuple_GET_SIZE(io) != 2) {
            Py_DECREF(io);
            PyErr_SetString(PyExc_ValueError, "io_messages must return (input, output)");
            goto fail;
        }
        PyObject *out = PyTuple_GET_ITEM(io, 1);
        set_slot(info, S_MESSAGES, Py_NewRef(PyTuple_GET_ITEM(io, 0)));
        int has_out = PyObject_IsTrue(out);
        PyObject *completion = NULL, *calls = NULL;
        if (has_out > 0) {  /* str(out[-1].get("content") or ""), out[-1].get("tool_calls") or None */
            PyObject *last = PySequence_GetItem(out, PySequence_Size(out) - 1);
            if (last != NULL) {
                PyObject *content = or_else(get_item(last, oi_constants[OC_CONTENT]), oi_constants[OC_EMPTY]);
                completion = content == NULL ? NULL : PyObject_Str(content);
                Py_XDECREF(content);
                if (completion != NULL) calls = or_else(get_item(last, oi_constants[OC_TOOL_CALLS]), NULL);
                Py_DECREF(last);
            }
        } else if (has_out == 0) {
            completion = Py_NewRef(oi_constants[OC_EMPTY]);
            calls = Py_NewRef(Py_None);
        }
        Py_DECREF(io);
        if (completion == NULL || calls == NULL) {
            Py_XDECREF(completion);
            goto fail;
        }
        set_slot(info, S_COMPLETION, completion);
        set_slot(info, S_TOOL_CALLS, calls);
        if ((t = oi_call(OH_AS_INT, oi_get(a, OK_PROMPT_TOKENS))) == NULL) goto fail;
        set_slot(info, S_INPUT_TOKENS, t);
        if ((t = oi_call(OH_AS_INT, oi_get(a, OK_COMPLETION_TOKENS))) == NULL) goto fail;
        set_slot(info, S_OUTPUT_TOKENS, t);
        set_slot(info, S_MODEL, interned(or_none(oi_get(a, OK_MODEL))));
    } else if (kind == oi_constants[OC_TOOL]) {
        PyObject *tool_name = or_else(or_none(oi_get(a, OK_TOOL_NAME)), name), *x;
        if (tool_name == NULL) goto fail;
        set_slot(info, S_TOOL_NAME, interned(tool_name));
        set_slot(info, S_TOOL_CALL_ID, or_none(oi_get(a, OK_TOOL_CALL_ID)));
        v = oi_get(a, OK_TOOL_PARAMETERS);  /* get(tool.parameters, get(input.value)) */
        if (v == NULL && !PyErr_Occurred()) v = oi_get(a, OK_INPUT_VALUE);
        if (PyErr_Occurred() || (x = oi_call(OH_JSON_OR, v)) == NULL) goto fail;
        set_slot(info, S_TOOL_ARGS, x);
        if ((x = oi_call(OH_TOOL_RESULT_TEXT, oi_get(a, OK_OUTPUT_VALUE))) == NULL) goto fail;
        set_slot(info, S_TOOL_RESULT, x);
    } else if (kind == oi_constants[OC_WORKFLOW]) {
        PyObject *x;
        set_slot(info, S_OUTCOME, or_none(oi_get(a, OK_OUTPUT_VALUE)));
        if ((x = oi_call(OH_WORKFLOW_METADATA, PyTuple_GET_ITEM(meta, 0))) == NULL) goto fail;
        set_slot(info, S_METADATA, x);
    }
    if (PyErr_Occurred()) goto fail;
    Py_DECREF(kind_text);
    Py_DECREF(meta);
    Py_DECREF(name);
    return info;

fail:
    Py_XDECREF(info);
    Py_XDECREF(kind_text);
    Py_XDECREF(meta);
    Py_XDECREF(session);
    Py_XDECREF(name);
    Py_XDECREF(agent);
    return NULL;
}

/* count_newlines(buffer): how many b"\n" it holds (memchr: many times faster than bytes.count on long lines). */
/* ---------- GenAI message lists ---------- */

/* `gen_ai.input.messages` / `gen_ai.output.messages` JSON of text and tool-call parts -> the chat messages
 * formats/genai._typed_messages builds ([{"role", "content"[, "tool_calls"]}]), or None for anything else
 * (other keys or part types, a key twice, escapes in keys, no messages), which then takes that typed path. */
static PyObject *g_role, *g_content, *g_tool_calls, *g_id, *g_name, *g_args, *g_user, *g_loads = NULL;

enum { P_TYPE = 1, P_CONTENT = 2, P_ID = 4, P_NAME = 8, P_ARGUMENTS = 16 };

typedef struct {
    PyObject *texts;  /* list of the text parts' contents */
    PyObject *calls;  /* list of tool-call dicts, or NULL */
} PartsAcc;

/* A str or null value (`*out` None for null). */
static int str_or_null(Parser *ps, PyObject **out) {
    if (peek(ps) == 'n') {
        int r = literal(ps, "null");
        if (r == OK) *out = Py_NewRef(Py_None);
        return r;
    }
    return parse_string(ps, out, CACHED_VALUE_LEN, 0);
}

static int genai_part(Parser *ps, void *ctx) {
    PartsAcc *acc = ctx;
    PyObject *content = NULL, *id = NULL, *name = NULL;
    const unsigned char *args = NULL, *args_end = NULL, *k;
    Py_ssize_t kn;
    int seen = 0, kind = 0, r = REJECT; /* kind 1: text, 2: tool_call */
    if (!eat(ps, '{')) return REJECT;
    if (!eat(ps, '}')) {
        for (;;) {
            if ((r = object_key(ps, &k, &kn)) != OK) goto done;
            int bit = key_is(k, kn, "type") ? P_TYPE : key_is(k, kn, "content") ? P_CONTENT : key_is(k, kn, "id") ? P_ID
                      : key_is(k, kn, "name") ? P_NAME : key_is(k, kn, "arguments") ? P_ARGUMENTS : 0;
            r = REJECT;
            if (bit == 0 || seen & bit) goto done;
            seen |= bit;
            if (bit == P_TYPE) {
                const unsigned char *t;
                Py_ssize_t tn;
                int flags;
                if ((r = scan_string(ps, &t, &tn, &flags)) != OK) goto done;
                r = REJECT;
                kind = flags ? 0 : key_is(t, tn, "text") ? 1 : key_is(t, tn, "tool_call") ? 2 : 0;
                if (!kind) goto done;
            } else if (bit == P_CONTENT) {
                if (peek(ps) != '"' || (r = parse_string(ps, &content, 0, 0)) != OK) goto done;
            } else if (bit == P_ID || bit == P_NAME) {
                if ((r = str_or_null(ps, bit == P_ID ? &id : &name)) != OK) goto done;
            } else {
                ws(ps);
                args = ps->p;
                if ((r = skip_value(ps)) != OK) goto done;
                args_end = ps->p;
            }
            int more = next_member(ps, '}');
            r = REJECT;
            if (more < 0) goto done;
            if (!more) break;
        }
    }
    r = REJECT;
    if (kind == 1 && seen == (P_TYPE | P_CONTENT)) {
        r = PyList_Append(acc->texts, content) < 0 ? FAIL : OK;
    } else if (kind == 2 && !(seen & P_CONTENT)) {
        PyObject *value = NULL, *call = NULL;
        if (args != NULL) {
            PyObject *raw = PyBytes_FromStringAndSize((const char *)args, args_end - args);
            value = raw == NULL ? NULL : PyObject_CallOneArg(g_loads, raw);
            Py_XDECREF(raw);
            if (value == NULL) {
                r = PyErr_ExceptionMatches(PyExc_ValueError) ? REJECT : FAIL;
                if (r == REJECT) PyErr_Clear();
                goto done;
            }
        }
        if (acc->calls == NULL && (acc->calls = PyList_New(0)) == NULL) r = FAIL;
        else if ((call = PyDict_New()) == NULL || PyDict_SetItem(call, g_id, id != NULL ? id : Py_None) < 0 ||
                 PyDict_SetItem(call, g_name, name != NULL ? name : Py_None) < 0 ||
                 PyDict_SetItem(call, g_args, value != NULL ? value : Py_None) < 0 || PyList_Append(acc->calls, call) < 0)
            r = FAIL;
        else
            r = OK;
        Py_XDECREF(call);
        Py_XDECREF(value);
    }
done:
    Py_XDECREF(content);
    Py_XDECREF(id);
    Py_XDECREF(name);
    return r;
}

static int genai_message(Parser *ps, void *out) {
    PyObject *role = NULL, *msg = NULL;
    PartsAcc acc = {PyList_New(0), NULL};
    const unsigned char *k;
    Py_ssize_t kn;
    int have_parts = 0, r = FAIL;
    if (acc.texts == NULL) return FAIL;
    r = REJECT;
    if (!eat(ps, '{') || eat(ps, '}')) goto done;
    for (;;) {
        if ((r = object_key(ps, &k, &kn)) != OK) goto done;
        r = REJECT;
        if (key_is(k, kn, "role")) {
            if (role != NULL || peek(ps) != '"' || (r = parse_string(ps, &role, CACHED_VALUE_LEN, 1)) != OK) goto done;
        } else if (key_is(k, kn, "parts")) {
            if (have_parts || (r = each_item(ps, 0, genai_part, &acc)) != OK) goto done;
            have_parts = 1;
        } else {
            goto done;
        }
        int more = next_member(ps, '}');
        r = REJECT;
        if (more < 0) goto done;
        if (!more) break;
    }
    if (!have_parts) goto done;
    r = FAIL;
    PyObject *content = PyList_GET_SIZE(acc.texts) == 1 ? Py_NewRef(PyList_GET_ITEM(acc.texts, 0))
                                                         : PyUnicode_Join(str_empty, acc.texts);
    if (content == NULL) goto done;
    msg = PyDict_New();
    if (msg == NULL || PyDict_SetItem(msg, g_role, role != NULL ? role : g_user) < 0 ||
        PyDict_SetItem(msg, g_content, content) < 0 ||
        (acc.calls != NULL && PyDict_SetItem(msg, g_tool_calls, acc.calls) < 0) || PyList_Append(out, msg) < 0) {
        Py_DECREF(content);
        goto done;
    }
    Py_DECREF(content);
    r = OK;
done:
    Py_XDECREF(msg);
    Py_XDECREF(role);
    Py_DECREF(acc.texts);
    Py_XDECREF(acc.calls);
    return r;
}

static PyObject *genai_messages(PyObject *module, PyObject *text) {
    Py_ssize_t n;
    const char *p = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    if (p == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;  /* not a str, or a lone surrogate */
    }
    if (g_loads == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "genai_messages: call configure_genai(loads) first");
        return NULL;
    }
    Parser ps = {(const unsigned char *)p, (const unsigned char *)p + n, 0};
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    int r = each_item(&ps, 0, genai_message, out);
    if (r == OK) {
        ws(&ps);
        if (ps.p != ps.end || PyList_GET_SIZE(out) == 0) r = REJECT;
    }
    if (r == OK) return out;
    Py_DECREF(out);
    if (r == FAIL) return NULL;
    Py_RETURN_NONE;
}

static PyObject *configure_genai(PyObject *module, PyObject *loads) {
    Py_XSETREF(g_loads, Py_NewRef(loads));
    Py_RETURN_NONE;
}

/* ---------- OpenInference metadata ---------- */

/* formats/openinference._metadata in C: the `metadata` attribute -> (metadata dict, node, agent, step, triggers,
 * task, session, scenario), through the same cache. The usual values (str ids, an int step, a list of str
 * triggers) are handled here; any other value goes to the Python helper that handles it. */
enum { MK_NODE, MK_CHECKPOINT_NS, MK_NS, MK_STEP, MK_TRIGGERS, MK_THREAD, MK_SESSION, MK_CONVERSATION, MK_SCENARIO,
       N_META_KEYS };
enum { MH_JSON_OR, MH_AS_INT, MH_AS_LIST, N_META_HELPERS };
static PyObject *meta_keys[N_META_KEYS], *meta_helpers[N_META_HELPERS], *meta_cache = NULL, *str_pipe = NULL;
static Py_ssize_t meta_cache_size = 0;

static PyObject *configure_oi_metadata(PyObject *module, PyObject *args) {
    PyObject *cache, *keys, *helpers;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O!nOO", &PyDict_Type, &cache, &size, &keys, &helpers)) return NULL;
    if (take_items(keys, meta_keys, N_META_KEYS, "keys") < 0 ||
        take_items(helpers, meta_helpers, N_META_HELPERS, "helpers") < 0)
        return NULL;
    Py_XSETREF(meta_cache, Py_NewRef(cache));
    meta_cache_size = size;
    if (str_pipe == NULL && (str_pipe = PyUnicode_FromString("|")) == NULL) return NULL;
    Py_RETURN_NONE;
}

/* `meta.get(x) or meta.get(y)` (a new reference, None when both are absent). */
static PyObject *meta_or(PyObject *meta, int x, int y) {
    PyObject *v = PyDict_GetItemWithError(meta, meta_keys[x]);
    if (v == NULL && PyErr_Occurred()) return NULL;
    if (v != NULL) {
        int t = PyObject_IsTrue(v);
        if (t < 0) return NULL;
        if (t) return Py_NewRef(v);
    }
    v = PyDict_GetItemWithError(meta, meta_keys[y]);
    if (v == NULL && PyErr_Occurred()) return NULL;
    return or_none(v);
}

/* base.agent_from_checkpoint_ns: 'outer:<id>|inner:<id>' -> 'outer|inner', else the node (`ns`: a str or None). */
static PyObject *agent_of(PyObject *ns, PyObject *node) {
    if (ns == Py_None || PyUnicode_GET_LENGTH(ns) == 0) return Py_NewRef(node);
    Py_ssize_t bar = PyUnicode_FindChar(ns, '|', 0, PyUnicode_GET_LENGTH(ns), 1);
    if (bar == -2) return NULL;
    if (bar < 0) return Py_NewRef(node);
    PyObject *segments = PyUnicode_Split(ns, str_pipe, -1), *heads = PyList_New(0), *out = NULL;
    if (segments == NULL || heads == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(segments); i++) {
        PyObject *seg = PyList_GET_ITEM(segments, i);
        Py_ssize_t len = PyUnicode_GET_LENGTH(seg);
        if (len == 0) continue;
        Py_ssize_t colon = PyUnicode_FindChar(seg, ':', 0, len, 1);
        if (colon == -2) goto done;
        PyObject *head = PyUnicode_Substring(seg, 0, colon < 0 ? len : colon);
        if (head == NULL || PyList_Append(heads, head) < 0) {
            Py_XDECREF(head);
            goto done;
        }
        Py_DECREF(head);
    }
    out = PyUnicode_Join(str_pipe, heads);
done:
    Py_XDECREF(segments);
    Py_XDECREF(heads);
    return out;
}

/* base.as_list for a list of str (a copy); anything else through the helper. */
static PyObject *list_of_str(PyObject *v) {
    if (v == NULL || v == Py_None) return Py_NewRef(Py_None);
    if (PyList_CheckExact(v)) {
        Py_ssize_t n = PyList_GET_SIZE(v), i = 0;
        while (i < n && PyUnicode_CheckExact(PyList_GET_ITEM(v, i))) i++;
        if (i == n) return PyList_GetSlice(v, 0, n);
    }
    return PyObject_CallOneArg(meta_helpers[MH_AS_LIST], v);
}

static PyObject *oi_metadata(PyObject *module, PyObject *value) {
    if (meta_cache == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "oi_metadata: call configure_oi_metadata first");
        return NULL;
    }
    const int text = PyUnicode_CheckExact(value);
    if (text) {
        PyObject *hit = PyDict_GetItemWithError(meta_cache, value);
        if (hit != NULL) return Py_NewRef(hit);
        if (PyErr_Occurred()) return NULL;
    }
    PyObject *meta = NULL, *node = NULL, *ns = NULL, *agent = NULL, *step = NULL, *triggers = NULL, *session = NULL;
    PyObject *scenario = NULL, *out = NULL, *empty = PyDict_New(), *v;
    if (empty == NULL) return NULL;
    meta = PyObject_CallFunctionObjArgs(meta_helpers[MH_JSON_OR], value, empty, NULL);
    if (meta == NULL) goto done;
    if (!PyDict_Check(meta)) Py_SETREF(meta, PyDict_New());
    if (meta == NULL) goto done;
    node = PyDict_GetItemWithError(meta, meta_keys[MK_NODE]);
    if (node == NULL && PyErr_Occurred()) goto done;
    if ((node = as_str(node)) == NULL) goto done;
    if ((ns = meta_or(meta, MK_CHECKPOINT_NS, MK_NS)) == NULL) goto done;
    Py_SETREF(ns, as_str(ns));
    if (ns == NULL) goto done;
    if ((agent = interned(agent_of(ns, node))) == NULL) goto done;
    v = PyDict_GetItemWithError(meta, meta_keys[MK_STEP]);
    if (v == NULL && PyErr_Occurred()) goto done;
    if (v == NULL || v == Py_None || PyLong_CheckExact(v)) step = or_none(v);
    else if ((step = PyObject_CallOneArg(meta_helpers[MH_AS_INT], v)) == NULL) goto done;
    v = PyDict_GetItemWithError(meta, meta_keys[MK_TRIGGERS]);
    if (v == NULL && PyErr_Occurred()) goto done;
    if ((triggers = list_of_str(v)) == NULL) goto done;
    ns = interned(ns);
    if ((session = meta_or(meta, MK_THREAD, MK_SESSION)) == NULL) goto done;
    int truth = PyObject_IsTrue(session);
    if (truth < 0) goto done;
    if (!truth) {
        v = PyDict_GetItemWithError(meta, meta_keys[MK_CONVERSATION]);
        if (v == NULL && PyErr_Occurred()) goto done;
        Py_SETREF(session, or_none(v));
    }
    session = interned(session);
    v = PyDict_GetItemWithError(meta, meta_keys[MK_SCENARIO]);
    if (v == NULL && PyErr_Occurred()) goto done;
    scenario = interned(or_none(v));
    out = PyTuple_Pack(8, meta, node, agent, step, triggers, ns, session, scenario);
    if (out != NULL && text) {
        if (PyDict_GET_SIZE(meta_cache) >= meta_cache_size) PyDict_Clear(meta_cache);
        if (PyDict_SetItem(meta_cache, value, out) < 0) Py_CLEAR(out);
    }
done:
    Py_DECREF(empty);
    Py_XDECREF(meta);
    Py_XDECREF(node);
    Py_XDECREF(ns);
    Py_XDECREF(agent);
    Py_XDECREF(step);
    Py_XDECREF(triggers);
    Py_XDECREF(session);
    Py_XDECREF(scenario);
    return out;
}

/* ---------- OpenInference messages ---------- */

/* formats/openinference.io_messages in C for a key set whose layout is known (`_layouts`): the input and output
 * messages built from the layout's specs, as `_build` does; a key set not seen yet, or without a layout, goes to
 * the Python function. */
static PyObject *io_layouts = NULL, *io_fallback = NULL, *io_json_or = NULL, *s_role, *s_tool_call_id, *s_tool_calls;
static PyObject *s_args;

static PyObject *configure_oi_messages(PyObject *module, PyObject *args) {
    PyObject *layouts, *fallback, *json_or;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &layouts, &fallback, &json_or)) return NULL;
    Py_XSETREF(io_layouts, Py_NewRef(layouts));
    Py_XSETREF(io_fallback, Py_NewRef(fallback));
    Py_XSETREF(io_json_or, Py_NewRef(json_or));
    if (s_role == NULL) {
        s_role = PyUnicode_InternFromString("role");
        s_tool_call_id = PyUnicode_InternFromString("tool_call_id");
        s_tool_calls = PyUnicode_InternFromString("tool_calls");
        s_args = PyUnicode_InternFromString("args");
        if (!s_role || !s_tool_call_id || !s_tool_calls || !s_args) return NULL;
    }
    Py_RETURN_NONE;
}

/* One field of a message (`plan`, the attribute's value): tool_call_id, or an attribute of tool call N. */
static int set_field(PyObject *msg, PyObject *plan, PyObject *value) {
    if (plan == Py_None) return 0;
    Py_ssize_t t_idx = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, 0));
    PyObject *t_attr = PyTuple_GET_ITEM(plan, 1);
    if (t_idx == -1 && PyErr_Occurred()) return -1;
    if (t_idx < 0) return PyDict_SetItem(msg, s_tool_call_id, value);
    PyObject *calls = PyDict_GetItemWithError(msg, s_tool_calls);
    if (calls == NULL) {
        if (PyErr_Occurred() || (calls = PyList_New(0)) == NULL) return -1;
        int r = PyDict_SetItem(msg, s_tool_calls, calls);
        Py_DECREF(calls);
        if (r < 0) return -1;
    }
    while (PyList_GET_SIZE(calls) <= t_idx) {
        PyObject *call = Py_BuildValue("{sOsOsO}", "id", Py_None, "name", Py_None, "args", Py_None);
        if (call == NULL || PyList_Append(calls, call) < 0) {
            Py_XDECREF(call);
            return -1;
        }
        Py_DECREF(call);
    }
    if (t_attr == Py_None) return 0;
    int is_args = PyUnicode_Compare(t_attr, s_args) == 0;
    PyObject *v = is_args ? PyObject_CallOneArg(io_json_or, value) : Py_NewRef(value);
    if (v == NULL) return -1;
    int r = PyDict_SetItem(PyList_GET_ITEM(calls, t_idx), t_attr, v);
    Py_DECREF(v);
    return r;
}

static PyObject *build_messages(PyObject *a, PyObject *specs) {
    if (!PyList_CheckExact(specs)) {
        PyErr_SetString(PyExc_TypeError, "oi_io_messages: a layout's specs must be a list");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(specs); i++) {
        PyObject *spec = PyList_GET_ITEM(specs, i), *role, *content, *others, *msg = NULL;
        if (!PyArg_ParseTuple(spec, "OOO!", &role, &content, &PyTuple_Type, &others)) goto fail;
        PyObject *role_v = role == Py_None ? g_user : PyObject_GetItem(a, role);
        PyObject *content_v = content == Py_None ? PyUnicode_FromStringAndSize(NULL, 0) : NULL;
        if (content != Py_None) {
            PyObject *c = PyObject_GetItem(a, content);
            content_v = c == NULL ? NULL : PyObject_Str(c);
            Py_XDECREF(c);
        }
        if (role_v == NULL || content_v == NULL || (msg = PyDict_New()) == NULL ||
            PyDict_SetItem(msg, s_role, role_v) < 0 || PyDict_SetItem(msg, g_content, content_v) < 0) {
            if (role != Py_None) Py_XDECREF(role_v);
            Py_XDECREF(content_v);
            Py_XDECREF(msg);
            goto fail;
        }
        if (role != Py_None) Py_DECREF(role_v);
        Py_DECREF(content_v);
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(others); k++) {
            PyObject *pair = PyTuple_GET_ITEM(others, k), *value;
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                (value = PyObject_GetItem(a, PyTuple_GET_ITEM(pair, 1))) == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "oi_io_messages: bad layout field");
                Py_DECREF(msg);
                goto fail;
            }
            int r = set_field(msg, PyTuple_GET_ITEM(pair, 0), value);
            Py_DECREF(value);
            if (r < 0) {
                Py_DECREF(msg);
                goto fail;
            }
        }
        int r = PyList_Append(out, msg);
        Py_DECREF(msg);
        if (r < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *oi_io_messages(PyObject *module, PyObject *a) {
    if (io_layouts == NULL || !PyDict_CheckExact(a)) {
        PyErr_SetString(PyExc_TypeError, "oi_io_messages(attrs: dict): call configure_oi_messages first");
        return NULL;
    }
    PyObject *keys = PySequence_Tuple(a);
    if (keys == NULL) return NULL;
    PyObject *layout = PyDict_GetItemWithError(io_layouts, keys);
    Py_DECREF(keys);
    if (layout == NULL && PyErr_Occurred()) return NULL;
    if (layout == NULL || layout == Py_None || !PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 2)
        return PyObject_CallOneArg(io_fallback, a);
    PyObject *in = build_messages(a, PyTuple_GET_ITEM(layout, 0));
    if (in == NULL) return NULL;
    PyObject *out = build_messages(a, PyTuple_GET_ITEM(layout, 1));
    if (out == NULL) {
        Py_DECREF(in);
        return NULL;
    }
    return Py_BuildValue("(NN)", in, out);
}

static PyObject *count_newlines(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *p = view.buf, *end = p + view.len;
    Py_ssize_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    while (p < end && (p = memchr(p, '\n', (size_t)(end - p))) != NULL) {
        n++;
        p++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

static PyObject *configure(PyObject *module, PyObject *type) {
    Py_XSETREF(raw_span_type, Py_NewRef(type));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"spans", (PyCFunction)(void (*)(void))spans, METH_FASTCALL,
     "spans(line, source) -> (list of RawSpan, count) for a well-formed OTLP/JSON line, or None."},
    {"configure", configure, METH_O, "configure(RawSpan): the span type to build."},
    {"configure_span_info", configure_span_info, METH_VARARGS, "configure_span_info(SpanInfo, defaults)."},
    {"configure_own", configure_own, METH_VARARGS, "configure_own(keys, helpers, constants)."},
    {"own_usual", (PyCFunction)(void (*)(void))own_usual, METH_FASTCALL,
     "own_usual(raw, attrs, op) -> SpanInfo: formats/own._parse_usual in C."},
    {"configure_oi", configure_oi, METH_VARARGS, "configure_oi(keys, helpers, constants)."},
    {"oi_usual", (PyCFunction)(void (*)(void))oi_usual, METH_FASTCALL,
     "oi_usual(raw, attrs) -> SpanInfo: formats/openinference.parse of a span without error, in C."},
    {"genai_messages", genai_messages, METH_O,
     "genai_messages(text) -> chat messages of GenAI text/tool-call parts JSON, or None (formats/genai.py)."},
    {"configure_genai", configure_genai, METH_O, "configure_genai(loads): the JSON parser of tool-call arguments."},
    {"configure_oi_metadata", configure_oi_metadata, METH_VARARGS,
     "configure_oi_metadata(cache, cache_size, keys, helpers): see formats/openinference.py."},
    {"oi_metadata", oi_metadata, METH_O, "oi_metadata(value) -> formats/openinference._metadata(value), in C."},
    {"configure_oi_messages", configure_oi_messages, METH_VARARGS,
     "configure_oi_messages(layouts, io_messages, json_or): see formats/openinference.py."},
    {"oi_io_messages", oi_io_messages, METH_O, "oi_io_messages(attrs) -> formats/openinference.io_messages(attrs)."},
    {"count_newlines", count_newlines, METH_O, "count_newlines(buffer) -> how many newline bytes it holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_otlp_c",
                                        "C fast path of marft_lg's OTLP/JSON reader.", -1, methods};

PyMODINIT_FUNC PyInit__otlp_c(void) {
    str_name = PyUnicode_InternFromString("name");
    str_attributes = PyUnicode_InternFromString("attributes");
    str_empty = PyUnicode_FromString("");
    if (str_name == NULL || str_attributes == NULL || str_empty == NULL) return NULL;
    g_role = PyUnicode_InternFromString("role");
    g_content = PyUnicode_InternFromString("content");
    g_tool_calls = PyUnicode_InternFromString("tool_calls");
    g_id = PyUnicode_InternFromString("id");
    g_name = PyUnicode_InternFromString("name");
    g_args = PyUnicode_InternFromString("args");
    g_user = PyUnicode_InternFromString("user");
    if (!g_role || !g_content || !g_tool_calls || !g_id || !g_name || !g_args || !g_user) return NULL;
    return PyModule_Create(&module_def);
}
