// CUDA kernels of commpress.ops (loaded by commpress/ops/cuda_backend.py through CuPy
// RawModule / NVRTC; compile-checked with nvcc for sm_80 and sm_90 by kernels/check.sh).
//
// Every kernel matches commpress/ops/reference.py bit for bit:
//  * fp32 arithmetic uses the __f*_rn intrinsics, which are never contracted into FMAs;
//  * magnitude order is the int32 bit pattern & 0x7fffffff (NaN > inf > finite);
//  * random numbers are the counter hash of the reference (lowbias32, two rounds).
// No host headers: NVRTC compiles this file as is.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define ABS_MASK 0x7fffffff
#define INF_KEY 0x7f800000
#define NAN_BITS 0x7fc00000

__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// counter_bits of element i (the caller reduces i mod 2**32).
__device__ __forceinline__ u32 bits24(u32 i, u32 k0, u32 k1) {
    u32 h = mix32(i ^ k0);
    h = mix32(h + k1);
    return h >> 8;
}

__device__ __forceinline__ float uniform24(u32 i, u32 k0, u32 k1) {
    return __fmul_rn((float)bits24(i, k0, k1), 1.0f / 16777216.0f);
}

// ------------------------------------------------------------------ random numbers, hashing
extern "C" __global__ void counter_bits_kernel(i64* out, u32 start, u32 k0, u32 k1, i64 n) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x)
        out[j] = (i64)bits24(start + (u32)j, k0, k1);
}

extern "C" __global__ void counter_uniform_kernel(float* out, u32 start, u32 k0, u32 k1, i64 n) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x)
        out[j] = uniform24(start + (u32)j, k0, k1);
}

extern "C" __global__ void hash_owner_kernel(const i64* idx, i64* out, u32 world, i64 n) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x)
        out[j] = (i64)(mix32((u32)(u64)idx[j]) % world);
}

// ------------------------------------------------------------------ selection
// Entry j is selected when lo <= (bits_j & 0x7fffffff) <= hi.
__device__ __forceinline__ bool selected(int v, int lo, int hi) {
    int k = v & ABS_MASK;
    return k >= lo && k <= hi;
}

// counts[c] = number of selected entries in chunk c ([c*clen, (c+1)*clen)); one block per chunk.
extern "C" __global__ void select_count(const int* xi, int lo, int hi, i64 n, i64 clen, i64* counts) {
    __shared__ i64 warp_sums[32];
    i64 a = blockIdx.x * clen;
    i64 b = min(a + clen, n);
    i64 cnt = 0;
    for (i64 j = a + threadIdx.x; j < b; j += blockDim.x) cnt += selected(xi[j], lo, hi);
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_down_sync(0xffffffffu, cnt, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = cnt;
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 total = 0;
        for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) total += warp_sums[w];
        counts[blockIdx.x] = total;
    }
}

// Compacts chunk c's selected entries (index order) at offsets[c] (exclusive prefix of counts).
// mode: 0 no residual; 1 res is xi (zero selected); 2 res = xi with selected zeroed; 3 res = xi.
// blockDim.x must be a multiple of 32 and at most 1024.
template <typename I>
__device__ void select_write_impl(const int* xi, int lo, int hi, i64 n, i64 clen, const i64* offsets,
                                  I* idx_out, int* val_out, int* res, int mode) {
    __shared__ int warp_counts[32];
    __shared__ i64 base;
    i64 a = blockIdx.x * clen;
    i64 b = min(a + clen, n);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (threadIdx.x == 0) base = offsets[blockIdx.x];
    __syncthreads();
    for (i64 t0 = a; t0 < b; t0 += blockDim.x) {
        i64 j = t0 + threadIdx.x;
        int v = 0;
        bool sel = false;
        if (j < b) {
            v = xi[j];
            sel = selected(v, lo, hi);
            if (mode == 3) res[j] = v;
            else if (mode == 2) res[j] = sel ? 0 : v;
            else if (mode == 1 && sel) res[j] = 0;
        }
        unsigned ballot = __ballot_sync(0xffffffffu, sel);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, tile_total = 0;
        for (int w = 0; w < nwarps; ++w) {
            int c = warp_counts[w];
            if (w < warp) before += c;
            tile_total += c;
        }
        if (sel) {
            i64 pos = base + before + __popc(ballot & ((1u << lane) - 1u));
            idx_out[pos] = (I)j;
            val_out[pos] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) base += tile_total;
        __syncthreads();
    }
}

extern "C" __global__ void select_write_i32(const int* xi, int lo, int hi, i64 n, i64 clen,
                                            const i64* offsets, int* idx_out, int* val_out, int* res,
                                            int mode) {
    select_write_impl<int>(xi, lo, hi, n, clen, offsets, idx_out, val_out, res, mode);
}

extern "C" __global__ void select_write_i64(const int* xi, int lo, int hi, i64 n, i64 clen,
                                            const i64* offsets, i64* idx_out, int* val_out, int* res,
                                            int mode) {
    select_write_impl<i64>(xi, lo, hi, n, clen, offsets, idx_out, val_out, res, mode);
}

// ------------------------------------------------------------------ scatter-add
// out[idx[j]] += val[j]; bad[0] = 1 when an index is out of range (that entry is skipped).
// Bitwise equal to the reference for unique indices (duplicates add in an unspecified order).
extern "C" __global__ void scatter_add_f32(float* out, const i64* idx, const float* val, i64 m, i64 n,
                                           int* bad) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < m; j += (i64)gridDim.x * blockDim.x) {
        i64 t = idx[j];
        if (t < 0 || t >= n) { bad[0] = 1; continue; }
        atomicAdd(out + t, val[j]);
    }
}

extern "C" __global__ void scatter_add_f64(double* out, const i64* idx, const double* val, i64 m,
                                           i64 n, int* bad) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < m; j += (i64)gridDim.x * blockDim.x) {
        i64 t = idx[j];
        if (t < 0 || t >= n) { bad[0] = 1; continue; }
        atomicAdd(out + t, val[j]);
    }
}

// ------------------------------------------------------------------ bit packing
// Element j's code occupies bits [j*bits, (j+1)*bits) of the byte stream, lowest bit first.
// One thread per group of 8 elements, which is exactly `bits` whole bytes.
__device__ __forceinline__ void write_group(u8* packed, i64 nbytes, i64 g, int bits, u64 acc) {
    i64 byte0 = g * bits;
    for (int t = 0; t < bits; ++t)
        if (byte0 + t < nbytes) packed[byte0 + t] = (u8)(acc >> (8 * t));
}

__device__ __forceinline__ u32 read_code(const u8* packed, i64 nbytes, i64 j, int bits) {
    i64 bit = j * bits;
    i64 byte = bit >> 3;
    u32 word = packed[byte];
    if (byte + 1 < nbytes) word |= (u32)packed[byte + 1] << 8;
    return (word >> (bit & 7)) & ((1u << bits) - 1u);
}

extern "C" __global__ void pack_bits_kernel(const u8* codes, u8* packed, int bits, i64 n, i64 nbytes) {
    i64 ngroups = (n + 7) / 8;
    u64 mask = (1ull << bits) - 1ull;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < ngroups; g += (i64)gridDim.x * blockDim.x) {
        u64 acc = 0;
        for (int e = 0; e < 8; ++e) {
            i64 j = g * 8 + e;
            if (j < n) acc |= ((u64)codes[j] & mask) << (e * bits);
        }
        write_group(packed, nbytes, g, bits, acc);
    }
}

extern "C" __global__ void unpack_bits_kernel(const u8* packed, u8* codes, int bits, i64 n, i64 nbytes) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x)
        codes[j] = (u8)read_code(packed, nbytes, j, bits);
}

// ------------------------------------------------------------------ block quantization
// scales[b] = max |x| over block b (fp32; NaN if the block holds a NaN).  One warp per block.
extern "C" __global__ void block_absmax_kernel(const int* xi, float* scales, i64 n, i64 block,
                                               i64 nblocks) {
    i64 warp_id = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = warp_id; b < nblocks; b += nwarps) {
        i64 a = b * block, e = min(a + block, n);
        int m = 0;
        for (i64 j = a + lane; j < e; j += 32) m = max(m, xi[j] & ABS_MASK);
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, o));
        if (lane == 0) scales[b] = __int_as_float(m > INF_KEY ? NAN_BITS : m);
    }
}

// q = floor(y) (NaN -> 0) clamped to [-qmax, qmax], as the code q + qmax.
__device__ __forceinline__ u32 to_code(float y, int qmax) {
    float q = floorf(y);
    if (q != q) q = 0.0f;
    float lim = (float)qmax;
    q = fminf(fmaxf(q, -lim), lim);
    return (u32)((int)q + qmax);
}

// Codes of block_quantize packed directly (one thread per 8 elements); needs scales first.
extern "C" __global__ void block_quantize_kernel(const float* x, const float* scales, u8* packed,
                                                 int bits, i64 block, i64 n, i64 nbytes,
                                                 int stochastic, u32 k0, u32 k1) {
    int qmax = (1 << (bits - 1)) - 1;
    float fq = (float)qmax;
    i64 ngroups = (n + 7) / 8;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < ngroups; g += (i64)gridDim.x * blockDim.x) {
        u64 acc = 0;
        i64 cur_block = -1;
        float inv = 0.0f;
        for (int e = 0; e < 8; ++e) {
            i64 j = g * 8 + e;
            if (j >= n) break;
            i64 b = j / block;
            if (b != cur_block) {
                cur_block = b;
                float s = scales[b];
                inv = s > 0.0f ? __fdiv_rn(fq, s) : 0.0f;
            }
            float y = __fmul_rn(x[j], inv);
            float r = stochastic ? uniform24((u32)j, k0, k1) : 0.5f;
            acc |= (u64)to_code(__fadd_rn(y, r), qmax) << (e * bits);
        }
        write_group(packed, nbytes, g, bits, acc);
    }
}

// out[j] (+)= (code_j - qmax) * (scale / qmax).
extern "C" __global__ void block_dequantize_kernel(const u8* packed, const float* scales, float* out,
                                                   int bits, i64 block, i64 n, i64 nbytes,
                                                   int accumulate) {
    int qmax = (1 << (bits - 1)) - 1;
    float fq = (float)qmax;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x) {
        float step = __fdiv_rn(scales[j / block], fq);
        float v = __fmul_rn(__fsub_rn((float)read_code(packed, nbytes, j, bits), fq), step);
        out[j] = accumulate ? __fadd_rn(out[j], v) : v;
    }
}

// ------------------------------------------------------------------ sign + scale
// bit j = !(x_j < 0); one thread per byte.
extern "C" __global__ void sign_bits_kernel(const float* x, u8* packed, i64 n, i64 nbytes) {
    for (i64 byte = blockIdx.x * (i64)blockDim.x + threadIdx.x; byte < nbytes;
         byte += (i64)gridDim.x * blockDim.x) {
        u32 v = 0;
        for (int t = 0; t < 8; ++t) {
            i64 j = byte * 8 + t;
            if (j < n && !(x[j] < 0.0f)) v |= 1u << t;
        }
        packed[byte] = (u8)v;
    }
}

// scales[c] = (pairwise tree sum of |x| over chunk c) / its length.  The tree is the reference's:
// the chunk zero-padded to a power of two P, adjacent pairs added level by level.  Blocks loop over
// chunks; blockDim.x must be a power of two <= 1024.  Thread t sums the aligned segment
// [t*S, (t+1)*S) (S = P / blockDim.x, at least 1) with a streaming binary counter, then the
// block adds the per-thread subtree sums pairwise.
extern "C" __global__ void sign_scales_kernel(const float* x, float* scales, i64 n, i64 chunk,
                                              i64 nchunks) {
    __shared__ float sums[1024];
    i64 P = 1;
    while (P < chunk) P <<= 1;
    i64 T = min((i64)blockDim.x, P);
    i64 S = P / T;
    for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {  // block-uniform loop
        i64 a = c * chunk, len = min(chunk, n - a);
        if ((i64)threadIdx.x < T) {
            float stack[64];
            int level[64];
            int top = 0;
            i64 s0 = threadIdx.x * S, s1 = min(s0 + S, len);
            for (i64 j = s0; j < s1; ++j) {
                float v = fabsf(x[a + j]);
                int lv = 0;
                while (top > 0 && level[top - 1] == lv) {
                    --top;
                    v = __fadd_rn(stack[top], v);
                    ++lv;
                }
                stack[top] = v;
                level[top] = lv;
                ++top;
            }
            float acc = 0.0f;
            if (top > 0) {
                acc = stack[top - 1];
                for (int t = top - 2; t >= 0; --t) acc = __fadd_rn(stack[t], acc);
            }
            sums[threadIdx.x] = acc;
        }
        __syncthreads();
        for (i64 w = T; w > 1; w >>= 1) {
            float v = 0.0f;
            if ((i64)threadIdx.x < w / 2) v = __fadd_rn(sums[2 * threadIdx.x], sums[2 * threadIdx.x + 1]);
            __syncthreads();
            if ((i64)threadIdx.x < w / 2) sums[threadIdx.x] = v;
            __syncthreads();
        }
        if (threadIdx.x == 0) scales[c] = __fdiv_rn(sums[0], (float)len);
        __syncthreads();
    }
}

// out[j] (+)= +scale or -scale of j's chunk by bit j.
extern "C" __global__ void sign_unpack_kernel(const u8* packed, const float* scales, float* out,
                                              i64 chunk, i64 n, int accumulate) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x) {
        float s = scales[j / chunk];
        float v = ((packed[j >> 3] >> (j & 7)) & 1) ? s : -s;
        out[j] = accumulate ? __fadd_rn(out[j], v) : v;
    }
}
