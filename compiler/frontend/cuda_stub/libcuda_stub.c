/* A stand-in libcuda.so.1 for tracing vLLM's CUDA build on a host without a GPU (docs/cuda.md).
 *
 * vLLM's CUDA kernel libraries (vllm/_C_stable_libtorch*.so, _moe_C_stable_libtorch*.so, _flashmla_C*.so,
 * _qutlass_C*.so) list libcuda.so.1 as NEEDED and bind these driver entry points; without a libcuda.so.1 they do not
 * import and vLLM falls back to its UnspecifiedPlatform. Every entry point answers CUDA_ERROR_NO_DEVICE: nothing
 * here runs a kernel, it only lets the libraries load so vLLM's Python code (model classes, loaders) can be traced.
 * Found with `nm -D --undefined-only` on the vLLM 0.33.0 wheel's libraries (cumem_allocator is not imported).
 */

#define CUDA_ERROR_NO_DEVICE 100

typedef int CUresult;

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

CUresult cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **function, int version, unsigned long long flags, int *status) {
    (void)symbol; (void)version; (void)flags;
    if (function) *function = 0;
    if (status) *status = 0;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
    (void)data; (void)attribute; (void)pointer;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuTensorMapEncodeTiled(void *tensor_map, int data_type, unsigned int rank, void *global_address,
                                const void *global_dim, const void *global_strides, const void *box_dim,
                                const void *element_strides, int interleave, int swizzle, int l2_promotion,
                                int oob_fill) {
    (void)tensor_map; (void)data_type; (void)rank; (void)global_address; (void)global_dim; (void)global_strides;
    (void)box_dim; (void)element_strides; (void)interleave; (void)swizzle; (void)l2_promotion; (void)oob_fill;
    return CUDA_ERROR_NO_DEVICE;
}
