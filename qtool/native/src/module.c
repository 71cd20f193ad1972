/* qtool.native._kernels: fused CPU kernels (see qtool/native/__init__.py for why). This file is the
 * top of the C layers: the Python method table, calling down into every kernel file; nothing
 * calls back into it (the helpers every file shares are common.c's). */
#include "qtool_native.h"

/* uninitialized(n) -> a bytearray of n bytes left as the allocator gives them: for outputs a
 * kernel fills whole, which bytearray(n) would zero first (a memset of every output piece) */
static PyObject *qt_py_uninitialized(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "uninitialized: a negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, n);
}

/* skip_prefixed(buf, pos, count) -> the offset just past `count` byte strings laid back to back
 * from `pos`, each a little-endian u64 length then that many bytes (GGUF's strings: a 49k-token
 * vocabulary is walked in ~0.1 ms, where the Python loop takes ~15), or -1 where one runs past
 * the end of `buf`. Every length is checked against what is left before it is added. */
static PyObject *qt_py_skip_prefixed(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t pos, count;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &pos, &count)) return NULL;
    if (pos < 0 || count < 0 || pos > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "skip_prefixed: a negative count or a position outside the buffer");
        return NULL;
    }
    const uint8_t *data = (const uint8_t *)buf.buf;
    const uint64_t size = (uint64_t)buf.len;
    uint64_t at = (uint64_t)pos;
    int past_end = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        if (size - at < 8) {
            past_end = 1;
            break;
        }
        uint64_t length = 0;
        for (int b = 7; b >= 0; b--) length = length << 8 | data[at + b]; /* little-endian on any host */
        at += 8;
        if (length > size - at) {
            past_end = 1;
            break;
        }
        at += length;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(past_end ? -1 : (Py_ssize_t)at);
}

static PyMethodDef methods[] = {
    {"encode_int", qt_py_encode_int, METH_VARARGS,
     "encode_int(src, dtype, cols, group, packed, scale, zero_point|None, bits, row0, row1, mse=False) -> (xx, xe, ee, max_abs_err, finite)"},
    {"pack_zero_points", qt_py_pack_zero_points, METH_VARARGS, "pack_zero_points(zero_point, rows, groups, bits, out)"},
    {"decode_int", qt_py_decode_int, METH_VARARGS,
     "decode_int(packed, scale, scale_dtype, zero_point|None, logical_dtype, out, out_dtype, cols, group, bits, rows, row0, row1)"},
    {"decode_gguf", qt_py_decode_gguf, METH_VARARGS,
     "decode_gguf(type_name, src, out, out_dtype, block0, block1)"},
    {"encode_gguf", qt_py_encode_gguf, METH_VARARGS,
     "encode_gguf(type_name, src, dtype, cols, out, row0, row1, importance=None) -> (xx, xe, ee, max_abs_err, finite)"},
    {"transcode_gguf", qt_py_transcode_gguf, METH_VARARGS,
     "transcode_gguf(type_name, src_type, src, cols, out, row0, row1, importance=None) -> (xx, xe, ee, max_abs_err, finite): encode_gguf of GGUF src_type rows"},
    {"kquant_set_lanes", qt_py_kquant_set_lanes, METH_VARARGS, "kquant_set_lanes(lanes): tests only, the K-quant searches no wider than 8 or 4 lanes"},
    {"mse_set_x86", qt_py_mse_set_x86, METH_VARARGS, "mse_set_x86(on): tests only, False keeps the mse search on its portable kernels"},
    {"gguf_set_avx512", qt_py_gguf_set_avx512, METH_VARARGS, "gguf_set_avx512(on) -> whether it is on: tests only, False keeps the Q8_0 rows and GGUF error sums on their portable kernels"},
    {"sum_squares", qt_py_sum_squares, METH_VARARGS,
     "sum_squares(src, dtype, count, slice, out, slice0, slice1): out[s] = sum x^2 (double) of slice s"},
    {"gptq_sweep", qt_py_gptq_sweep, METH_VARARGS,
     "gptq_sweep(w, u, b, scale, zero_point|None, gidx, groups, bits, codes, errors, col0, col1, row0, row1): GPTQ's sweep of block columns [col0, col1)"},
    {"uninitialized", qt_py_uninitialized, METH_VARARGS, "uninitialized(n) -> bytearray of n bytes, not zeroed"},
    {"skip_prefixed", qt_py_skip_prefixed, METH_VARARGS,
     "skip_prefixed(buf, pos, count) -> offset past count u64-length-prefixed strings from pos, or -1 past the end"},
    {"gguf_encoders", qt_py_gguf_encoders, METH_NOARGS, "gguf_encoders() -> {type name: (values, bytes) per block}"},
    {"gguf_decoders", qt_py_gguf_decoders, METH_NOARGS, "gguf_decoders() -> {type name: (values, bytes) per block}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "qtool's fused CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
