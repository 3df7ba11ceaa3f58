/*
 * skippyd._chain: the warm-prefix block chain, at C speed.
 *
 * For a key K (32 bytes) and data split into blocks B_0, B_1, ... of `block_bytes` each:
 *
 *     d_j = BLAKE3_keyed(K, B_j)                     (standard BLAKE3, single-chunk input)
 *     h_j = BLAKE3_keyed(K, h_{j-1} || d_j)          (h_{-1} = 32 zero bytes)
 *
 * and the result is the first `out_len` bytes of every h_j, concatenated. Every value is a standard
 * BLAKE3 keyed hash, so skippyd/keys.py computes the same chain with the `blake3` package alone; this
 * module only makes it fast: the d_j are hashed many at a time with the SIMD `blake3_hash_many`, and
 * each link of the chain is one compression. The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "blake3/blake3.h"
#include "blake3/blake3_impl.h"

#define BATCH 64

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer key, data;
    Py_ssize_t block_bytes, out_len;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nn", &key, &data, &block_bytes, &out_len)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (key.len != BLAKE3_KEY_LEN) {
        PyErr_SetString(PyExc_ValueError, "the key must be 32 bytes");
        goto done;
    }
    if (block_bytes <= 0 || block_bytes % BLAKE3_BLOCK_LEN || block_bytes > BLAKE3_CHUNK_LEN) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be a multiple of 64 and at most 1024");
        goto done;
    }
    if (out_len <= 0 || out_len > BLAKE3_OUT_LEN) {
        PyErr_SetString(PyExc_ValueError, "out_len must be between 1 and 32");
        goto done;
    }
    Py_ssize_t n = data.len / block_bytes;
    result = PyBytes_FromStringAndSize(NULL, n * out_len);
    if (result == NULL) {
        goto done;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *base = (const uint8_t *)data.buf;
    uint32_t key_words[8];
    load_key_words((const uint8_t *)key.buf, key_words);
    Py_BEGIN_ALLOW_THREADS
    uint8_t digests[BATCH * BLAKE3_OUT_LEN];
    const uint8_t *inputs[BATCH];
    uint8_t link[BLAKE3_BLOCK_LEN];
    uint32_t cv[8];
    memset(link, 0, BLAKE3_OUT_LEN); /* h_{-1} */
    for (Py_ssize_t start = 0; start < n; start += BATCH) {
        Py_ssize_t m = n - start < BATCH ? n - start : BATCH;
        for (Py_ssize_t i = 0; i < m; i++) {
            inputs[i] = base + (start + i) * block_bytes;
        }
        blake3_hash_many(inputs, (size_t)m, (size_t)(block_bytes / BLAKE3_BLOCK_LEN), key_words, 0, false,
                         KEYED_HASH, CHUNK_START, CHUNK_END | ROOT, digests);
        for (Py_ssize_t i = 0; i < m; i++) {
            memcpy(link + BLAKE3_OUT_LEN, digests + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
            memcpy(cv, key_words, sizeof cv);
            blake3_compress_in_place(cv, link, BLAKE3_BLOCK_LEN, 0,
                                     KEYED_HASH | CHUNK_START | CHUNK_END | ROOT);
            store_cv_words(link, cv); /* h_j becomes the first half of the next link */
            memcpy(out + (start + i) * out_len, link, (size_t)out_len);
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return result;
}

/*
 * bind_each(key, keys) -> list[bytes]: BLAKE3_keyed(key, u8(len(k)) || k)[:32] for every k of the list
 * (each 1 to 64 bytes), one bytes each (what the tiers index by). The public BLAKE3 API only; the GIL is
 * released while it hashes.
 */
#define BIND_MAX_KEY 64

/* bind_each's digests, into out (n * 32 bytes); 0, or -1 with an exception set. */
static int bind_into(Py_buffer *key, PyObject *keys, uint8_t *out) {
    if (key->len != BLAKE3_KEY_LEN) {
        PyErr_SetString(PyExc_ValueError, "the key must be 32 bytes");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint8_t *packed = PyMem_Malloc((size_t)(n > 0 ? n : 1) * (BIND_MAX_KEY + 1));
    if (packed == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(item)) {
            PyErr_Format(PyExc_TypeError, "key %zd is not bytes", i);
            PyMem_Free(packed);
            return -1;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(item);
        if (len < 1 || len > BIND_MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "key %zd is %zd bytes; keys are 1 to 64 bytes", i, len);
            PyMem_Free(packed);
            return -1;
        }
        uint8_t *slot = packed + i * (BIND_MAX_KEY + 1);
        slot[0] = (uint8_t)len;
        memcpy(slot + 1, PyBytes_AS_STRING(item), (size_t)len);
    }
    Py_BEGIN_ALLOW_THREADS
    blake3_hasher hasher;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *slot = packed + i * (BIND_MAX_KEY + 1);
        blake3_hasher_init_keyed(&hasher, (const uint8_t *)key->buf);
        blake3_hasher_update(&hasher, slot, (size_t)slot[0] + 1);
        blake3_hasher_finalize(&hasher, out + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(packed);
    return 0;
}

static PyObject *bind_each(PyObject *self, PyObject *args) {
    Py_buffer key;
    PyObject *keys;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!", &key, &PyList_Type, &keys)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint8_t *out = PyMem_Malloc((size_t)(n > 0 ? n : 1) * BLAKE3_OUT_LEN);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (bind_into(&key, keys, out) < 0) {
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)out + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, digest);
    }
done:
    PyMem_Free(out);
    PyBuffer_Release(&key);
    return result;
}

static PyObject *implementation(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromSize_t(blake3_simd_degree());
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(key, data, block_bytes, out_len) -> bytes"},
    {"bind_each", bind_each, METH_VARARGS, "bind_each(key, keys) -> list[bytes]: each key bound to the 32-byte key"},
    {"simd_degree", implementation, METH_NOARGS, "how many inputs BLAKE3 hashes at once here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "skippyd._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
