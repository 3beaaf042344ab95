// mpidp fused pack/unpack: copy N device tensors to or from one flat buffer in ONE launch,
// optionally scaling and casting (float32 <-> float16 / bfloat16 for compressed buckets).
//
// Work is cut into chunks of at most MPIDP_CHUNK elements that never cross a tensor
// boundary; block b handles chunk b. The host builds the chunk table once per bucket
// layout (sizes do not change between steps) and the table of the tensors' addresses once
// per set of addresses (see kernels/_cuda.py).
// Every size and offset is 64-bit: a bucket may hold more than 2^31 elements.
//
// One source serves every dtype: the kernels are templates, instantiated by name through
// CuPy's name_expressions (see kernels/_cuda.py), or by MPIDP_INSTANTIATE for nvcc checks.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

// Arithmetic happens in float, or in double when either side is double.
template <typename A, typename B> struct mpidp_acc { typedef float type; };
template <typename B> struct mpidp_acc<double, B> { typedef double type; };
template <typename A> struct mpidp_acc<A, double> { typedef double type; };
template <> struct mpidp_acc<double, double> { typedef double type; };

template <typename T> __device__ __forceinline__ float mpidp_to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float mpidp_to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float mpidp_to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename Acc, typename T> __device__ __forceinline__ Acc mpidp_load(T v) {
    return static_cast<Acc>(mpidp_to_float(v));
}
template <> __device__ __forceinline__ double mpidp_load<double, double>(double v) { return v; }

template <typename T> __device__ __forceinline__ T mpidp_store(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half mpidp_store<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 mpidp_store<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> __device__ __forceinline__ T mpidp_store_acc(double v) { return static_cast<T>(v); }
template <typename T> __device__ __forceinline__ T mpidp_store_acc(float v) { return mpidp_store<T>(v); }

template <typename A, typename B> struct mpidp_same_type { static const bool value = false; };
template <typename A> struct mpidp_same_type<A, A> { static const bool value = true; };

// Copy one element, scaled if asked. Unscaled copies of one type never round-trip
// through float, so int64 and bool pass bit for bit.
template <typename Src, typename Dst>
__device__ __forceinline__ Dst mpidp_convert(Src v, double scale, int scaled) {
    if constexpr (mpidp_same_type<Src, Dst>::value) {
        if (!scaled) return v;
    }
    typedef typename mpidp_acc<Src, Dst>::type Acc;
    Acc x = mpidp_load<Acc>(v);
    if (scaled) x = x * static_cast<Acc>(scale);
    return mpidp_store_acc<Dst>(x);
}

// Copy n elements, UNROLL loads in flight per thread before their stores (a loop that
// loads and stores one element at a time keeps too few bytes in flight to stream).
#define MPIDP_UNROLL 4

template <typename In, typename Out, typename Convert>
__device__ __forceinline__ void mpidp_stream(const In* __restrict__ from, Out* __restrict__ to,
                                             int n, Convert convert) {
    for (int base = threadIdx.x; base < n; base += MPIDP_UNROLL * blockDim.x) {
        In v[MPIDP_UNROLL];
#pragma unroll
        for (int k = 0; k < MPIDP_UNROLL; ++k) {
            const int i = base + k * blockDim.x;
            if (i < n) v[k] = from[i];
        }
#pragma unroll
        for (int k = 0; k < MPIDP_UNROLL; ++k) {
            const int i = base + k * blockDim.x;
            if (i < n) to[i] = convert(v[k]);
        }
    }
}

struct mpidp_bits {
    template <typename T> __device__ __forceinline__ T operator()(T v) const { return v; }
};

template <typename Src, typename Dst> struct mpidp_converter {
    double scale;
    int scaled;
    __device__ __forceinline__ Dst operator()(Src v) const { return mpidp_convert<Src, Dst>(v, scale, scaled); }
};

// A copy of one type, unscaled, whose two ends are 16-byte aligned moves 16 bytes per load.
template <typename Src, typename Dst>
__device__ __forceinline__ void mpidp_copy(const Src* __restrict__ src, Dst* __restrict__ dst,
                                           int count, double scale, int scaled) {
    if constexpr (mpidp_same_type<Src, Dst>::value) {
        const unsigned long long ends = reinterpret_cast<unsigned long long>(src)
                                      | reinterpret_cast<unsigned long long>(dst);
        if (!scaled && (ends & 15) == 0) {
            const int bytes = count * static_cast<int>(sizeof(Src));
            const int vectors = bytes >> 4;
            mpidp_stream(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), vectors,
                         mpidp_bits());
            const unsigned char* __restrict__ tail_from = reinterpret_cast<const unsigned char*>(src);
            unsigned char* __restrict__ tail_to = reinterpret_cast<unsigned char*>(dst);
            for (int i = (vectors << 4) + threadIdx.x; i < bytes; i += blockDim.x) tail_to[i] = tail_from[i];
            return;
        }
    }
    mpidp_stream(src, dst, count, mpidp_converter<Src, Dst>{scale, scaled});
}

// Chunk table: for chunk c, the tensor it lies in, its first element within that tensor
// and its length. offsets[t] is tensor t's first element in the flat buffer.
template <typename Src, typename Dst>
__global__ void mpidp_pack(const unsigned long long* __restrict__ tensors,
                           const i64* __restrict__ offsets,
                           const int* __restrict__ chunk_tensor,
                           const i64* __restrict__ chunk_start,
                           const int* __restrict__ chunk_count,
                           Dst* __restrict__ flat, double scale, int scaled) {
    const i64 c = blockIdx.x;
    const int t = chunk_tensor[c];
    const i64 begin = chunk_start[c];
    mpidp_copy<Src, Dst>(reinterpret_cast<const Src*>(tensors[t]) + begin, flat + offsets[t] + begin,
                         chunk_count[c], scale, scaled);
}

template <typename Src, typename Dst>
__global__ void mpidp_unpack(const Src* __restrict__ flat,
                             const unsigned long long* __restrict__ tensors,
                             const i64* __restrict__ offsets,
                             const int* __restrict__ chunk_tensor,
                             const i64* __restrict__ chunk_start,
                             const int* __restrict__ chunk_count,
                             double scale, int scaled) {
    const i64 c = blockIdx.x;
    const int t = chunk_tensor[c];
    const i64 begin = chunk_start[c];
    mpidp_copy<Src, Dst>(flat + offsets[t] + begin, reinterpret_cast<Dst*>(tensors[t]) + begin,
                         chunk_count[c], scale, scaled);
}

// Explicit instantiation, for compiling this file on its own (the nvcc check).
#define MPIDP_INSTANTIATE(Src, Dst)                                                          \
    template __global__ void mpidp_pack<Src, Dst>(const unsigned long long*, const i64*,    \
        const int*, const i64*, const int*, Dst*, double, int);                              \
    template __global__ void mpidp_unpack<Src, Dst>(const Src*, const unsigned long long*,  \
        const i64*, const int*, const i64*, const int*, double, int);
