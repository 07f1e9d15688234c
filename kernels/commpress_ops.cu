// CUDA kernels of commpress.ops (compiled by NVRTC with cuda_backend.NVRTC_OPTIONS and launched
// through CuPy by commpress/ops/cuda_backend.py; compile-checked with nvcc and NVRTC for sm_80 and sm_90 by kernels/check.sh
// and kernels/nvrtc_check.py; built for the host with kernels/host/cuda_shim.h and run by the
// parity tests in CI).
//
// Every kernel matches commpress/ops/reference.py bit for bit:
//  * fp32 arithmetic uses the __f*_rn intrinsics, which are never contracted into FMAs and keep
//    subnormals (--ftz=false: CuPy's RawModule would add -ftz=true; no float atomics, which flush
//    them);
//  * magnitude order is the int32 bit pattern & 0x7fffffff (NaN > inf > finite);
//  * random numbers are the counter hash of the reference (lowbias32, two rounds).
// Every loop over elements is grid-stride, so any grid size is correct (the host build tests
// grids of one or two blocks).  Loops that contain warp shuffles or ballots are warp-uniform.
// No host headers: NVRTC compiles this file as is.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define ABS_MASK 0x7fffffff
#define INF_KEY 0x7f800000
#define NAN_BITS 0x7fc00000
#define FULL 0xffffffffu

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

__device__ __forceinline__ i64 global_thread() { return blockIdx.x * (i64)blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }
__device__ __forceinline__ i64 global_warp() { return global_thread() >> 5; }
__device__ __forceinline__ i64 grid_warps() { return grid_threads() >> 5; }

// v[e] = p[j0 + e] for e < 8 (0 where j0 + e >= lim).  On the GPU, two 16-byte loads when p is
// 16-byte aligned (j0 is a multiple of 8) and all eight are in range: with a thread per 8 adjacent
// elements, 4-byte accesses make each warp instruction touch 8 cache lines (block_quantize ran at
// 56% of an H200's peak).  The host build takes the element loop (same values).
__device__ __forceinline__ bool vec8(const float* p, i64 j0, i64 lim) {
    return j0 + 8 <= lim && (((u64)p) & 15) == 0;
}

__device__ __forceinline__ void load8(const float* p, i64 j0, i64 lim, float* v) {
#ifdef __CUDA_ARCH__
    if (vec8(p, j0, lim)) {
        float4 a = *reinterpret_cast<const float4*>(p + j0);
        float4 b = *reinterpret_cast<const float4*>(p + j0 + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
#endif
    for (int e = 0; e < 8; ++e) v[e] = j0 + e < lim ? p[j0 + e] : 0.0f;
}

// p[j0 + e] = v[e] for e < 8 with j0 + e < lim (two 16-byte stores on the GPU, as load8).
__device__ __forceinline__ void store8(float* p, i64 j0, i64 lim, const float* v) {
#ifdef __CUDA_ARCH__
    if (vec8(p, j0, lim)) {
        *reinterpret_cast<float4*>(p + j0) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(p + j0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
#endif
    for (int e = 0; e < 8; ++e)
        if (j0 + e < lim) p[j0 + e] = v[e];
}

// ------------------------------------------------------------------ random numbers, hashing
extern "C" __global__ void counter_bits_kernel(i64* out, u32 start, u32 k0, u32 k1, i64 n) {
    for (i64 j = global_thread(); j < n; j += grid_threads())
        out[j] = (i64)bits24(start + (u32)j, k0, k1);
}

extern "C" __global__ void counter_uniform_kernel(float* out, u32 start, u32 k0, u32 k1, i64 n) {
    for (i64 j = global_thread(); j < n; j += grid_threads())
        out[j] = uniform24(start + (u32)j, k0, k1);
}

// world is 64-bit: the sparse collectives hash into 2**32 buckets (then owner = the hash itself).
extern "C" __global__ void hash_owner_kernel(const i64* idx, i64* out, u64 world, i64 n) {
    for (i64 j = global_thread(); j < n; j += grid_threads())
        out[j] = (i64)((u64)mix32((u32)(u64)idx[j]) % world);
}

// ------------------------------------------------------------------ selection
// A selection is {lo, hi, tie, need}: entry j (key k = bits_j & 0x7fffffff) is selected when
// lo < k <= hi, or when k == tie and fewer than `need` entries with key `tie` come before it.
// Top-k passes `sel`, four int64 in device memory written by radix_pick: {T, max, T, need} (T the
// k-th largest key).  Threshold passes sel = NULL and the scalars lo, hi (no ties: tie = -1).
//
// Work is split into segments of `seg` elements (a multiple of 128), one warp per segment: no
// block barriers, 4 independent loads in flight per lane.  sel_count writes per segment the number
// of entries in (lo, hi] and the number equal to tie; sel_write compacts a segment's selected
// entries in index order at its offset (inclusive prefix sums of both counts, minus its own).
#define SEL_UNROLL 4

__device__ __forceinline__ void load_tile(const int* xi, i64 t, i64 b, int lane, int* v) {
#pragma unroll
    for (int u = 0; u < SEL_UNROLL; ++u) {
        i64 j = t + u * 32 + lane;
        v[u] = j < b ? xi[j] : 0;
    }
}

extern "C" __global__ void sel_count(const int* xi, i64 n, i64 seg, const i64* sel, i64 lo, i64 hi,
                                     i64* counts) {
    i64 tie = -1;
    if (sel) {
        lo = sel[0];
        hi = sel[1];
        tie = sel[2];
    }
    i64 nseg = (n + seg - 1) / seg;
    int lane = threadIdx.x & 31;
    for (i64 s = global_warp(); s < nseg; s += grid_warps()) {  // warp-uniform
        i64 a = s * seg, b = min(a + seg, n);
        i64 above = 0, ties = 0;
        for (i64 t = a; t < b; t += 32 * SEL_UNROLL) {
            int v[SEL_UNROLL];
            load_tile(xi, t, b, lane, v);
#pragma unroll
            for (int u = 0; u < SEL_UNROLL; ++u) {
                if (t + u * 32 + lane < b) {
                    i64 k = v[u] & ABS_MASK;
                    above += (k > lo && k <= hi);
                    ties += (k == tie);
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            above += __shfl_down_sync(FULL, above, o);
            ties += __shfl_down_sync(FULL, ties, o);
        }
        if (lane == 0) {
            counts[s] = above;
            counts[nseg + s] = ties;
        }
    }
}

// counts: sel_count's two rows; incl: their inclusive prefix sums (row by row, same layout).
// mode: 0 no residual; 1 res is xi (zero the selected); 2 res = xi with selected zeroed.
template <typename I>
__device__ void sel_write_impl(const int* xi, i64 n, i64 seg, const i64* sel, i64 lo, i64 hi,
                               const i64* counts, const i64* incl, I* idx_out, int* val_out, int* res,
                               int mode) {
    i64 tie = -1, need = 0;
    if (sel) {
        lo = sel[0];
        hi = sel[1];
        tie = sel[2];
        need = sel[3];
    }
    i64 nseg = (n + seg - 1) / seg;
    int lane = threadIdx.x & 31;
    u32 below = (1u << lane) - 1u;
    for (i64 s = global_warp(); s < nseg; s += grid_warps()) {  // warp-uniform
        i64 a = s * seg, b = min(a + seg, n);
        i64 tie_rank = incl[nseg + s] - counts[nseg + s];
        i64 pos = incl[s] - counts[s] + min(tie_rank, need);
        for (i64 t = a; t < b; t += 32 * SEL_UNROLL) {
            int v[SEL_UNROLL];
            load_tile(xi, t, b, lane, v);
#pragma unroll
            for (int u = 0; u < SEL_UNROLL; ++u) {
                i64 j = t + u * 32 + lane;
                i64 k = v[u] & ABS_MASK;
                bool in = j < b;
                bool is_tie = in && k == tie;
                u32 ties = __ballot_sync(FULL, is_tie);
                bool take = in && ((k > lo && k <= hi) || (is_tie && tie_rank + __popc(ties & below) < need));
                u32 taken = __ballot_sync(FULL, take);
                if (take) {
                    i64 p = pos + __popc(taken & below);
                    idx_out[p] = (I)j;
                    val_out[p] = v[u];
                }
                if (in && mode == 2) res[j] = take ? 0 : v[u];
                else if (take && mode == 1) res[j] = 0;
                pos += __popc(taken);
                tie_rank += __popc(ties);
            }
        }
    }
}

extern "C" __global__ void sel_write_i32(const int* xi, i64 n, i64 seg, const i64* sel, i64 lo, i64 hi,
                                         const i64* counts, const i64* incl, int* idx_out,
                                         int* val_out, int* res, int mode) {
    sel_write_impl<int>(xi, n, seg, sel, lo, hi, counts, incl, idx_out, val_out, res, mode);
}

extern "C" __global__ void sel_write_i64(const int* xi, i64 n, i64 seg, const i64* sel, i64 lo, i64 hi,
                                         const i64* counts, const i64* incl, i64* idx_out,
                                         int* val_out, int* res, int mode) {
    sel_write_impl<i64>(xi, n, seg, sel, lo, hi, counts, incl, idx_out, val_out, res, mode);
}

// ------------------------------------------------------------------ radix select (top-k)
// Finds T, the k-th largest key, in three passes over the keys' bits (11, 10, 10), entirely on the
// device.  state = {prefix, krem, lo, hi, tie, need}: prefix holds the bits of T found so far,
// krem how many of the entries matching that prefix are still to take (the first pass starts
// from prefix 0 and krem = k without reading the state, so it needs no initialization).
// Pass p: radix_hist counts, over the entries whose key >> (shift + nbits) equals the prefix,
// the digit (key >> shift) & (2**nbits - 1); radix_pick chooses the digit holding the krem-th
// largest and updates the state.  After the last pass prefix = T and krem = the number of
// entries equal to T to take (lowest indices first); radix_pick then writes sel = {T, max, T, krem}.
#define RADIX_MAX_BINS 2048

// hist must be zero before the pass.
extern "C" __global__ void radix_hist(const int* xi, i64 n, const i64* state, int first, int shift,
                                      int nbits, u64* hist) {
    __shared__ u32 local[RADIX_MAX_BINS];
    int nbins = 1 << nbits;
    i64 prefix = first ? 0 : state[0];
    for (int i = threadIdx.x; i < nbins; i += blockDim.x) local[i] = 0;
    __syncthreads();
    i64 stride = grid_threads();
    int lane = threadIdx.x & 31;
    // Warp-uniform loop (t - lane is the warp's base), so the lanes can aggregate: gradients put
    // most keys in a few bins (exact zeros in one), so the lanes in lane 0's bin add once through
    // lane 0 (a shuffle and a ballot; __match_any_sync per element cost 26% of peak on an H200)
    // and the others add alone, their same-bin conflicts serialized by the hardware.
    for (i64 t = global_thread(); t - lane < n; t += 4 * stride) {
        int v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = t + u * stride < n ? xi[t + u * stride] : 0;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int k = v[u] & ABS_MASK;
            bool counted = t + u * stride < n && (i64)(k >> (shift + nbits)) == prefix;
            int bin = counted ? (k >> shift) & (nbins - 1) : -1;
            int lead = __shfl_sync(FULL, bin, 0);
            u32 with_lead = __ballot_sync(FULL, bin == lead);
            if (lane == 0 && lead >= 0) atomicAdd(&local[lead], (u32)__popc(with_lead));
            else if (bin >= 0 && bin != lead) atomicAdd(&local[bin], 1u);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nbins; i += blockDim.x)
        if (local[i]) atomicAdd(&hist[i], (u64)local[i]);
}

// One warp (blockDim.x == 32, grid 1).  Lane l owns bins [nbins - (l+1)w, nbins - l w), highest first.
extern "C" __global__ void radix_pick(const u64* hist, int nbits, int first, int last, i64 k,
                                      i64* state) {
    int lane = threadIdx.x & 31;
    int nbins = 1 << nbits, w = nbins / 32;
    i64 krem = first ? k : state[1];
    i64 prefix0 = first ? 0 : state[0];
    int top = nbins - lane * w;  // bins [top - w, top)
    i64 mine = 0;
    for (int b = top - w; b < top; ++b) mine += (i64)hist[b];
    i64 incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        i64 up = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += up;
    }
    u32 reach = __ballot_sync(FULL, incl >= krem);
    if (reach == 0) return;  // cannot happen when 1 <= k <= n
    int owner = __ffs(reach) - 1;
    if (lane == owner) {
        i64 acc = incl - mine;  // entries above this lane's bins
        int digit = top - w;
        for (int b = top - 1; b >= top - w; --b) {
            if (acc + (i64)hist[b] >= krem) { digit = b; break; }
            acc += (i64)hist[b];
        }
        i64 prefix = (prefix0 << nbits) | digit;
        krem -= acc;
        state[0] = prefix;
        state[1] = krem;
        if (last) {
            state[2] = prefix;
            state[3] = ABS_MASK;
            state[4] = prefix;
            state[5] = krem;
        }
    }
}

// ------------------------------------------------------------------ scatter-add
// bad[0] |= 1 when any index is outside [0, n).  Run before scatter_add_*, which then writes
// nothing at all: the output is either fully updated or untouched, with no host round trip.
extern "C" __global__ void scatter_check(const i64* idx, i64 m, i64 n, int* bad) {
    for (i64 j = global_thread(); j < m; j += grid_threads()) {
        i64 t = idx[j];
        if (t < 0 || t >= n) atomicOr(bad, 1);
    }
}

// out[idx[j]] += val[j] as an IEEE add (subnormals kept: no float atomicAdd, which flushes them)
// committed with a compare-and-swap of the bits: bitwise index_add_ for unique indices (one CAS
// each, no retry), and no lost update for duplicate indices (their order is unspecified).
#ifndef COMMPRESS_HOST
// A load that races with other threads' atomics on the same word (the host shim's is atomic).
__device__ __forceinline__ u32 load_relaxed(const u32* p) { return *(const volatile u32*)p; }
__device__ __forceinline__ u64 load_relaxed(const u64* p) { return *(const volatile u64*)p; }
#endif

extern "C" __global__ void scatter_add_f32(float* out, const i64* idx, const float* val, i64 m,
                                           const int* bad) {
    if (*bad) return;
    for (i64 j = global_thread(); j < m; j += grid_threads()) {
        u32* word = (u32*)(out + idx[j]);
        float v = val[j];
        u32 old = load_relaxed(word), seen;
        do {
            seen = old;
            old = atomicCAS(word, seen, __float_as_uint(__fadd_rn(__uint_as_float(seen), v)));
        } while (old != seen);
    }
}

extern "C" __global__ void scatter_add_f64(double* out, const i64* idx, const double* val, i64 m,
                                           const int* bad) {
    if (*bad) return;
    for (i64 j = global_thread(); j < m; j += grid_threads()) {
        u64* word = (u64*)(out + idx[j]);
        double v = val[j];
        u64 old = load_relaxed(word), seen;
        do {
            seen = old;
            old = atomicCAS(word, seen,
                            (u64)__double_as_longlong(__dadd_rn(__longlong_as_double((i64)seen), v)));
        } while (old != seen);
    }
}

// ------------------------------------------------------------------ bit packing
// Element j's code occupies bits [j*bits, (j+1)*bits) of the byte stream, lowest bit first.
// One thread per group of 8 elements, which is exactly `bits` whole bytes.
// On the GPU a group of 2, 4 or 8 whole bytes inside the stream and aligned to its size moves as
// one little-endian word (byte t = bits 8t.. of acc, as the loop below), so a warp's stores are
// not 8 one-byte accesses per lane (block_quantize's packing ran at 56% of an H200's peak).
__device__ __forceinline__ bool group_word(const u8* p, i64 byte0, i64 nbytes, int bits) {
    return (bits == 2 || bits == 4 || bits == 8) && byte0 + bits <= nbytes && ((u64)(p + byte0) & (bits - 1)) == 0;
}

__device__ __forceinline__ void write_group(u8* packed, i64 nbytes, i64 g, int bits, u64 acc) {
    i64 byte0 = g * bits;
#ifdef __CUDA_ARCH__
    if (group_word(packed, byte0, nbytes, bits)) {
        if (bits == 8) *reinterpret_cast<u64*>(packed + byte0) = acc;
        else if (bits == 4) *reinterpret_cast<u32*>(packed + byte0) = (u32)acc;
        else *reinterpret_cast<unsigned short*>(packed + byte0) = (unsigned short)acc;
        return;
    }
#endif
    for (int t = 0; t < bits; ++t)
        if (byte0 + t < nbytes) packed[byte0 + t] = (u8)(acc >> (8 * t));
}

__device__ __forceinline__ u64 read_group(const u8* packed, i64 nbytes, i64 g, int bits) {
    i64 byte0 = g * bits;
#ifdef __CUDA_ARCH__
    if (group_word(packed, byte0, nbytes, bits)) {
        if (bits == 8) return *reinterpret_cast<const u64*>(packed + byte0);
        if (bits == 4) return *reinterpret_cast<const u32*>(packed + byte0);
        return *reinterpret_cast<const unsigned short*>(packed + byte0);
    }
#endif
    u64 acc = 0;
    for (int t = 0; t < bits; ++t)
        if (byte0 + t < nbytes) acc |= (u64)packed[byte0 + t] << (8 * t);
    return acc;
}

extern "C" __global__ void pack_bits_kernel(const u8* codes, u8* packed, int bits, i64 n, i64 nbytes) {
    i64 ngroups = (n + 7) / 8;
    u64 mask = (1ull << bits) - 1ull;
    for (i64 g = global_thread(); g < ngroups; g += grid_threads()) {
        u64 acc = 0;
        for (int e = 0; e < 8; ++e) {
            i64 j = g * 8 + e;
            if (j < n) acc |= ((u64)codes[j] & mask) << (e * bits);
        }
        write_group(packed, nbytes, g, bits, acc);
    }
}

extern "C" __global__ void unpack_bits_kernel(const u8* packed, u8* codes, int bits, i64 n, i64 nbytes) {
    i64 ngroups = (n + 7) / 8;
    u64 mask = (1ull << bits) - 1ull;
    for (i64 g = global_thread(); g < ngroups; g += grid_threads()) {
        u64 acc = read_group(packed, nbytes, g, bits);
        for (int e = 0; e < 8; ++e) {
            i64 j = g * 8 + e;
            if (j < n) codes[j] = (u8)((acc >> (e * bits)) & mask);
        }
    }
}

// ------------------------------------------------------------------ block quantization
// scales[b] = max |x| over block b (fp32; NaN if the block holds a NaN); when inv is not null,
// inv[b] = qmax / scales[b] (0 when the scale is not > 0), the factor block_quantize multiplies by.
// A group of `width` lanes (a power of two <= 32, >= min(block, 32)) reduces one block, so small
// blocks keep every lane busy; the loop over groups is warp-uniform.
extern "C" __global__ void block_absmax_kernel(const int* xi, float* scales, float* inv, int qmax,
                                               i64 n, i64 block, i64 nblocks, int width) {
    int lane = threadIdx.x & 31;
    int per_warp = 32 / width, sub = lane & (width - 1);
    float fq = (float)qmax;
    for (i64 b0 = global_warp() * per_warp; b0 < nblocks; b0 += grid_warps() * per_warp) {
        i64 b = b0 + lane / width;
        int m = 0;
        if (b < nblocks) {
            i64 a = b * block, e = min(a + block, n);
#pragma unroll 4
            for (i64 j = a + sub; j < e; j += width) m = max(m, xi[j] & ABS_MASK);  // 4 loads in flight
        }
        for (int o = width >> 1; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
        if (sub == 0 && b < nblocks) {
            float s = __int_as_float(m > INF_KEY ? NAN_BITS : m);
            scales[b] = s;
            if (inv) inv[b] = s > 0.0f ? __fdiv_rn(fq, s) : 0.0f;
        }
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

// Codes of block_quantize packed directly (one thread per 8 elements): one division per group for
// the block index, then a compare per element; the per-block factor comes from block_absmax.
extern "C" __global__ void block_quantize_kernel(const float* x, const float* inv, u8* packed,
                                                 int bits, i64 block, i64 n, i64 nbytes,
                                                 int stochastic, u32 k0, u32 k1) {
    int qmax = (1 << (bits - 1)) - 1;
    i64 ngroups = (n + 7) / 8;
    for (i64 g = global_thread(); g < ngroups; g += grid_threads()) {
        i64 j0 = g * 8;
        i64 b = j0 / block, next = (b + 1) * block;
        float f = inv[b];
        float xv[8];
        load8(x, j0, n, xv);
        u64 acc = 0;
        for (int e = 0; e < 8; ++e) {
            i64 j = j0 + e;
            if (j >= n) break;
            if (j == next) {
                ++b;
                next += block;
                f = inv[b];
            }
            float y = __fmul_rn(xv[e], f);
            float r = stochastic ? uniform24((u32)j, k0, k1) : 0.5f;
            acc |= (u64)to_code(__fadd_rn(y, r), qmax) << (e * bits);
        }
        write_group(packed, nbytes, g, bits, acc);
    }
}

// Code j of a packed stream (bits [j*bits, (j+1)*bits), lowest bit first): one or two bytes.
__device__ __forceinline__ u32 read_code(const u8* packed, i64 nbytes, i64 j, int bits, u32 mask) {
    i64 bit = j * bits, byte = bit >> 3;
    int sh = (int)(bit & 7);
    u32 w = packed[byte];
    if (sh + bits > 8 && byte + 1 < nbytes) w |= (u32)packed[byte + 1] << 8;
    return (w >> sh) & mask;
}

// j / d, in 32 bits where both fit (a fraction of the 64-bit division's cost).
__device__ __forceinline__ i64 index_div(i64 j, i64 d) {
    return (j <= 0xFFFFFFFFll && d <= 0xFFFFFFFFll) ? (i64)((u32)j / (u32)d) : j / d;
}

// out[j] (+)= (code_j - qmax) * (scale / qmax).  A warp takes tiles of 32 * DQ_UNROLL adjacent
// elements, lane l element l of each 32, so every load and store is coalesced (one thread per 8
// adjacent elements, as before, ran at 21% of an H200's peak); the step is divided again only
// when a lane enters a new block (lanes move forward only).
#define DQ_UNROLL 8
__device__ __forceinline__ void dequantize_groups(const u8* packed, const float* scales, float* out,
                                                  int bits, i64 block, i64 n, i64 nbytes,
                                                  int accumulate, int qmax) {
    float fq = (float)qmax;
    u32 mask = (1u << bits) - 1u;
    int lane = threadIdx.x & 31;
    i64 next = 0;  // the end of the block whose step this lane holds
    float step = 0.0f;
    const i64 tile = 32 * DQ_UNROLL;
    for (i64 base = global_warp() * tile; base < n; base += grid_warps() * tile) {
        u32 codes[DQ_UNROLL];
        float prev[DQ_UNROLL];
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            i64 j = base + u * 32 + lane;
            codes[u] = j < n ? read_code(packed, nbytes, j, bits, mask) : 0u;
            prev[u] = (accumulate && j < n) ? out[j] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            i64 j = base + u * 32 + lane;
            if (j < n) {
                if (j >= next) {
                    i64 b = index_div(j, block);
                    next = (b + 1) * block;
                    step = __fdiv_rn(scales[b], fq);
                }
                float v = __fmul_rn(__fsub_rn((float)codes[u], fq), step);
                out[j] = accumulate ? __fadd_rn(prev[u], v) : v;
            }
        }
    }
}

extern "C" __global__ void block_dequantize_kernel(const u8* packed, const float* scales, float* out,
                                                   int bits, i64 block, i64 n, i64 nbytes,
                                                   int accumulate) {
    dequantize_groups(packed, scales, out, bits, block, n, nbytes, accumulate, (1 << (bits - 1)) - 1);
}

// level_dequantize: (code - levels) * (s_b / levels), same loop with the offset `levels`.
extern "C" __global__ void level_dequantize_kernel(const u8* packed, const float* scales, float* out,
                                                   int bits, i64 bucket, int levels, i64 n, i64 nbytes,
                                                   int accumulate) {
    dequantize_groups(packed, scales, out, bits, bucket, n, nbytes, accumulate, levels);
}

// ------------------------------------------------------------------ sign + scale
// bit j = !(x_j < 0); one thread per byte.
extern "C" __global__ void sign_bits_kernel(const float* x, u8* packed, i64 n, i64 nbytes) {
    for (i64 byte = global_thread(); byte < nbytes; byte += grid_threads()) {
        float xv[8];
        load8(x, byte * 8, n, xv);
        u32 v = 0;
        for (int t = 0; t < 8; ++t)
            if (byte * 8 + t < n && !(xv[t] < 0.0f)) v |= 1u << t;
        packed[byte] = (u8)v;
    }
}

// One level of the reference's pairwise tree (chunk zero-padded to a power of two P, adjacent
// pairs added level by level).  The input is nseg segments of `seg` values (the last may be
// short: the segment's length is min(seg, n - c*seg)); each warp sums aligned groups of 256 of a
// segment (8 adjacent values per lane in registers, then 5 shuffle levels), writing
// out[c * G + g], G = ceil(seg / 256).  Because zero padding does not change a sum of
// non-negative values, a group of 256 is a subtree of the reference's tree, and the host runs
// levels until G == 1; the last (finalize 1) divides the root by the chunk's length
// min(chunk, n_orig - c*chunk), or (finalize 2, bucket norms) takes its square root in fp64
// rounded once to fp32 when the root is in [NORM_TINY, inf) and otherwise writes -1, for
// norm_rescue_kernel.  Leaves (first level only) are y (leaf 0), |y| (1) or y*y (2).  Warps loop
// over (segment, group) items, one per warp: no barriers.
#define NORM_TINY 8.673617379884035e-19f  // 2**-60: reference.NORM_TINY
#define F32_MAX 3.4028234663852886e38

// The pairwise tree of a group of 256 leaves, 8 adjacent ones per lane; the root on lane 0.
__device__ __forceinline__ float warp_tree256(float* v, int lane) {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = __fadd_rn(v[2 * e], v[2 * e + 1]);
    v[0] = __fadd_rn(v[0], v[1]);
    v[1] = __fadd_rn(v[2], v[3]);
    float s = __fadd_rn(v[0], v[1]);
    for (int o = 1; o < 32; o <<= 1) {
        float other = __shfl_down_sync(FULL, s, o);
        if ((lane & (2 * o - 1)) == 0) s = __fadd_rn(s, other);
    }
    return s;
}

// The roots of consecutive groups of 256 combined in the reference's order: a stack of complete
// subtrees (zero padding adds nothing), merged as equal levels meet; total() folds what is left.
struct RootStack {
    float stack[64];
    int level[64];
    int top = 0;

    __device__ __forceinline__ void push(float s) {
        int lv = 0;
        while (top > 0 && level[top - 1] == lv) {
            s = __fadd_rn(stack[--top], s);
            ++lv;
        }
        stack[top] = s;
        level[top++] = lv;
    }

    __device__ __forceinline__ float total() const {
        float acc = top ? stack[top - 1] : 0.0f;
        for (int t = top - 2; t >= 0; --t) acc = __fadd_rn(stack[t], acc);
        return acc;
    }
};

extern "C" __global__ void tree256_kernel(const float* in, float* out, i64 n, i64 seg, i64 nseg,
                                          int leaf, int finalize, i64 chunk, i64 n_orig) {
    int lane = threadIdx.x & 31;
    i64 G = (seg + 255) / 256;
    for (i64 it = global_warp(); it < nseg * G; it += grid_warps()) {  // warp-uniform
        i64 c = it / G, g = it - c * G;
        i64 len = min(seg, n - c * seg);
        i64 base = c * seg, first = g * 256 + lane * 8;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float y = first + e < len ? in[base + first + e] : 0.0f;
            v[e] = leaf == 1 ? fabsf(y) : leaf == 2 ? __fmul_rn(y, y) : y;
        }
        float s = warp_tree256(v, lane);
        if (lane == 0) {
            if (finalize == 2) out[c] = s >= NORM_TINY && s < __int_as_float(INF_KEY) ? (float)sqrt((double)s) : -1.0f;
            else if (finalize) out[c] = __fdiv_rn(s, (float)min(chunk, n_orig - c * chunk));
            else out[it] = s;
        }
    }
}

// The rescue of reference.bucket_norms, one warp per bucket whose norm tree256_kernel marked -1
// (the others return at once): k from the bucket's largest bits(|x|) (reference.norm_shift),
// the pairwise tree of (x * 2**k)**2 in groups of 256 (warp_tree256) whose roots lane 0 combines
// in the reference's order (a stack of complete subtrees, as zero padding adds nothing), then
// sqrt(S) * 2**-k in fp64, saturated at the fp32 maximum when finite, rounded once to fp32.
extern "C" __global__ void norm_rescue_kernel(const float* x, float* norms, i64 n, i64 bucket, i64 nb) {
    int lane = threadIdx.x & 31;
    for (i64 c = global_warp(); c < nb; c += grid_warps()) {  // warp-uniform
        if (!(norms[c] < 0.0f)) continue;
        i64 base = c * bucket, len = min(bucket, n - base);
        int m = 0;
        for (i64 j = lane; j < len; j += 32) m = max(m, __float_as_int(x[base + j]) & ABS_MASK);
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
        int k = min(max(127 - (m >> 23), -126), 126);
        float f = __int_as_float((127 + k) << 23);
        RootStack roots;
        for (i64 g0 = 0; g0 < len; g0 += 256) {  // warp-uniform
            i64 first = g0 + lane * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float y = first + e < len ? __fmul_rn(x[base + first + e], f) : 0.0f;
                v[e] = __fmul_rn(y, y);
            }
            float s = warp_tree256(v, lane);
            if (lane == 0) roots.push(s);
        }
        if (lane == 0) {
            float acc = roots.total();
            double r = sqrt((double)acc) * __longlong_as_double((i64)(1023 - k) << 52);
            if (r > F32_MAX && r < __longlong_as_double(0x7ff0000000000000LL)) r = F32_MAX;
            norms[c] = (float)r;
        }
    }
}

// reference.sign_pack's rescue, one warp per chunk whose scale the tree kernels left +inf (the
// others return at once): a finite chunk (largest bits(|x|) below INF_KEY) is summed again on
// |x| * 2**-32 (SIGN_RESCUE_SHIFT, exact) in groups of 256 (warp_tree256) whose roots lane 0
// combines in the reference's order (as norm_rescue_kernel), then (sum / len) * 2**32, saturated
// at the fp32 maximum.  A chunk holding inf keeps its +inf.
#define SIGN_DOWN 2.3283064365386963e-10f  // 2**-32
#define SIGN_UP 4294967296.0f              // 2**32

__device__ __forceinline__ float sign_rescued(float acc, i64 len) {
    float r = __fmul_rn(__fdiv_rn(acc, (float)len), SIGN_UP);
    return r < __int_as_float(INF_KEY) ? r : (float)F32_MAX;
}

extern "C" __global__ void sign_rescue_kernel(const float* x, float* scales, i64 n, i64 chunk, i64 nchunks) {
    int lane = threadIdx.x & 31;
    for (i64 c = global_warp(); c < nchunks; c += grid_warps()) {  // warp-uniform
        if (!(scales[c] == __int_as_float(INF_KEY))) continue;
        i64 base = c * chunk, len = min(chunk, n - base);
        int m = 0;
        for (i64 j = lane; j < len; j += 32) m = max(m, __float_as_int(x[base + j]) & ABS_MASK);
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
        if (m >= INF_KEY) continue;
        RootStack roots;
        for (i64 g0 = 0; g0 < len; g0 += 256) {  // warp-uniform
            i64 first = g0 + lane * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = first + e < len ? __fmul_rn(fabsf(x[base + first + e]), SIGN_DOWN) : 0.0f;
            float s = warp_tree256(v, lane);
            if (lane == 0) roots.push(s);
        }
        if (lane == 0) {
            float acc = roots.total();
            scales[c] = sign_rescued(acc, len);
        }
    }
}

// out[j] (+)= +scale or -scale of j's chunk by bit j.
extern "C" __global__ void sign_unpack_kernel(const u8* packed, const float* scales, float* out,
                                              i64 chunk, i64 n, int accumulate) {
    for (i64 j = global_thread(); j < n; j += grid_threads()) {
        float s = scales[j / chunk];
        float v = ((packed[j >> 3] >> (j & 7)) & 1) ? s : -s;
        out[j] = accumulate ? __fadd_rn(out[j], v) : v;
    }
}

// ------------------------------------------------------------------ minifloats: fp8 and MX
// The code of fp32 y rounded to a minifloat with `mbits` mantissa bits, smallest normal exponent
// `emin`, sign bit `sbit` and largest finite value of bit pattern `fmax_key` (saturating; see
// reference.minifloat_codes): a = min(|y|, max) (as bit patterns: same order), e = max(exponent
// of a, emin), r = a * 2**(M - e) (exact), q = floor(r), f = r - q; up by nearest-even or by the
// counter noise of element j; NaN gives code 0.
__device__ __forceinline__ u32 minifloat_code(float y, int mbits, int emin, int sbit, int fmax_key,
                                              int stochastic, u32 j, u32 k0, u32 k1) {
    int yi = __float_as_int(y);
    int ab = yi & ABS_MASK;
    if (ab > INF_KEY) return 0u;
    int ak = min(ab, fmax_key);
    int e = max((ak >> 23) - 127, emin);
    float r = __fmul_rn(__int_as_float(ak), __int_as_float((mbits - e + 127) << 23));
    float q = floorf(r);
    float f = __fsub_rn(r, q);
    int qi = (int)q;
    int up = stochastic ? (uniform24(j, k0, k1) < f) : (f > 0.5f || (f == 0.5f && (qi & 1)));
    u32 mag = (u32)(((e - emin) << mbits) + qi + up);
    return yi < 0 ? mag | (u32)sbit : mag;
}

// fp8 codes (one byte per element) and scales[b] = amax_b / fmax in one kernel: a group of `width`
// lanes (as block_absmax_kernel) takes the block's max |x|, then codes x * (fmax / amax) (0 unless
// amax > 0), re-reading the block from cache.  The loop over groups is warp-uniform.
extern "C" __global__ void fp8_quantize_kernel(const float* x, u8* codes, float* scales, i64 n,
                                               i64 block, i64 nblocks, int width, int mbits, int emin,
                                               int sbit, int fmax_key, int stochastic, u32 k0, u32 k1) {
    const int* xi = (const int*)x;
    int lane = threadIdx.x & 31;
    int per_warp = 32 / width, sub = lane & (width - 1);
    float fmax = __int_as_float(fmax_key);
    for (i64 b0 = global_warp() * per_warp; b0 < nblocks; b0 += grid_warps() * per_warp) {
        i64 b = b0 + lane / width;
        i64 a = b * block, e = min(a + block, n);
        int m = 0;
        if (b < nblocks)
            for (i64 j = a + sub; j < e; j += width) m = max(m, xi[j] & ABS_MASK);
        for (int o = width >> 1; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
        if (b < nblocks) {
            float amax = __int_as_float(m > INF_KEY ? NAN_BITS : m);
            if (sub == 0) scales[b] = __fdiv_rn(amax, fmax);
            float inv = amax > 0.0f ? __fdiv_rn(fmax, amax) : 0.0f;
            for (i64 j = a + sub; j < e; j += width)
                codes[j] = (u8)minifloat_code(__fmul_rn(x[j], inv), mbits, emin, sbit, fmax_key,
                                              stochastic, (u32)j, k0, k1);
        }
    }
}

// OCP MX in one pass: one warp per block of 32 (lane = element).  The shared exponent
// X = max(exponent of amax - emax, -127) (scale byte X + 127; 255 and factor 0 when the block
// holds a NaN/inf), codes of x * 2**-X packed by groups of 8 lanes (`bits` whole bytes each).
extern "C" __global__ void mx_quantize_kernel(const float* x, u8* packed, u8* scale_bytes, i64 n,
                                              i64 nbytes, int bits, int emax, int mbits, int emin,
                                              int sbit, int fmax_key, int stochastic, u32 k0, u32 k1) {
    int lane = threadIdx.x & 31;
    i64 nblocks = (n + 31) / 32;
    for (i64 b = global_warp(); b < nblocks; b += grid_warps()) {  // warp-uniform
        i64 j = b * 32 + lane;
        bool in = j < n;
        float v = in ? x[j] : 0.0f;
        int m = __float_as_int(v) & ABS_MASK;
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
        float inv = 0.0f;
        u32 byte = 255u;
        if (m < INF_KEY) {
            int shared = max((m >> 23) - 127 - emax, -127);
            byte = (u32)(shared + 127);
            inv = __int_as_float((127 - shared) << 23);
        }
        if (lane == 0) scale_bytes[b] = (u8)byte;
        u32 code = in ? minifloat_code(__fmul_rn(v, inv), mbits, emin, sbit, fmax_key, stochastic,
                                       (u32)j, k0, k1) : 0u;
        u64 acc = (u64)code << ((lane & 7) * bits);
        for (int o = 1; o < 8; o <<= 1) acc |= __shfl_xor_sync(FULL, acc, o);
        if ((lane & 7) == 0 && j < n) write_group(packed, nbytes, j >> 3, bits, acc);
    }
}

// out[j] (+)= table[code_j] * scale of j's block, one thread per 8 elements (`bits` whole bytes).
// The scale is scales[b] (fp8) or, when scales is null, scale_table[scale_bytes[b]] (MX, E8M0).
// `table` holds the value of every code (the reference's table: NaN codes included).
extern "C" __global__ void table_dequantize_kernel(const u8* packed, const float* table,
                                                   const float* scales, const u8* scale_bytes,
                                                   const float* scale_table, float* out, int bits,
                                                   i64 block, i64 n, i64 nbytes, int accumulate) {
    u64 mask = (1ull << bits) - 1ull;
    i64 ngroups = (n + 7) / 8;
    for (i64 g = global_thread(); g < ngroups; g += grid_threads()) {
        i64 j0 = g * 8;
        i64 b = j0 / block, next = (b + 1) * block;
        float s = scales ? scales[b] : scale_table[scale_bytes[b]];
        u64 acc = read_group(packed, nbytes, g, bits);
        float ov[8];
        if (accumulate) load8(out, j0, n, ov);
        for (int e = 0; e < 8; ++e) {
            i64 j = j0 + e;
            if (j >= n) break;
            if (j == next) {
                ++b;
                next += block;
                s = scales ? scales[b] : scale_table[scale_bytes[b]];
            }
            float v = __fmul_rn(table[(acc >> (e * bits)) & mask], s);
            ov[e] = accumulate ? __fadd_rn(ov[e], v) : v;
        }
        store8(out, j0, n, ov);
    }
}

// ------------------------------------------------------------------ QSGD / TernGrad levels
// reference.level_multiplier: m = fl / s, or, where that is not a normal fp32 (nor 0),
// m = fl / (s * p) with the exact pre-scale p of |x| (2**64 when fl / s overflowed, 2**-64 when
// it is subnormal).
__device__ __forceinline__ float level_multiplier(float fl, float s, float* p) {
    float m = __fdiv_rn(fl, s);
    *p = 1.0f;
    if (m == __int_as_float(INF_KEY)) *p = 18446744073709551616.0f;
    else if (m > 0.0f && m < 1.1754943508222875e-38f) *p = 5.421010862427522e-20f;
    else return m;
    return __fdiv_rn(fl, __fmul_rn(s, *p));
}

// Codes of level_quantize packed directly (one thread per 8 elements): for bucket b,
// (m, p) = level_multiplier(levels, s_b > 0 ? s_b : 1); q = clamp(floor((|x| * p) * m + u_j), 0,
// levels) (NaN -> 0); code levels -+ q by x's sign bit.
extern "C" __global__ void level_quantize_kernel(const float* x, const float* scales, u8* packed,
                                                 int bits, i64 bucket, int levels, i64 n, i64 nbytes,
                                                 u32 k0, u32 k1) {
    float fl = (float)levels;
    i64 ngroups = (n + 7) / 8;
    for (i64 g = global_thread(); g < ngroups; g += grid_threads()) {
        i64 j0 = g * 8;
        i64 b = j0 / bucket, next = (b + 1) * bucket;
        float s = scales[b], pre;
        float mul = level_multiplier(fl, s > 0.0f ? s : 1.0f, &pre);
        float xv[8];
        load8(x, j0, n, xv);
        u64 acc = 0;
        for (int e = 0; e < 8; ++e) {
            i64 j = j0 + e;
            if (j >= n) break;
            if (j == next) {
                ++b;
                next += bucket;
                s = scales[b];
                mul = level_multiplier(fl, s > 0.0f ? s : 1.0f, &pre);
            }
            float v = xv[e];
            float q = floorf(__fadd_rn(__fmul_rn(__fmul_rn(fabsf(v), pre), mul), uniform24((u32)j, k0, k1)));
            if (q != q) q = 0.0f;
            int qi = (int)fminf(fmaxf(q, 0.0f), fl);
            u32 code = (u32)(__float_as_int(v) < 0 ? levels - qi : levels + qi);
            acc |= (u64)code << (e * bits);
        }
        write_group(packed, nbytes, g, bits, acc);
    }
}

// ------------------------------------------------------------------ sign + error feedback
// c = x + r * beta (x + r when !use_beta) written to c, and its sign bits (bit j = !(c_j < 0));
// one thread per byte.  c may alias r (each element is read, then written, by one thread).
extern "C" __global__ void feedback_sign_kernel(const float* x, const float* r, float beta, int use_beta,
                                                float* c, u8* packed, i64 n, i64 nbytes) {
    for (i64 byte = global_thread(); byte < nbytes; byte += grid_threads()) {
        float xv[8], rv[8], cv[8];
        load8(x, byte * 8, n, xv);
        load8(r, byte * 8, n, rv);
        u32 v = 0;
        for (int t = 0; t < 8; ++t) {
            float cj = use_beta ? __fadd_rn(xv[t], __fmul_rn(rv[t], beta)) : __fadd_rn(xv[t], rv[t]);
            cv[t] = cj;
            if (byte * 8 + t < n && !(cj < 0.0f)) v |= 1u << t;
        }
        store8(c, byte * 8, n, cv);
        packed[byte] = (u8)v;
    }
}

// c[j] -= (bit j ? scale : -scale) of j's chunk: the residual error feedback keeps.
extern "C" __global__ void sign_residual_kernel(const u8* packed, const float* scales, float* c,
                                                i64 chunk, i64 n) {
    for (i64 j = global_thread(); j < n; j += grid_threads()) {
        float s = scales[j / chunk];
        c[j] = __fsub_rn(c[j], ((packed[j >> 3] >> (j & 7)) & 1) ? s : -s);
    }
}

// sign_pack_feedback in one pass over HBM, for chunks of whole bytes and at most 32 groups of 256
// (chunk % 8 == 0, chunk <= 8192): one warp per chunk.  Pass 1 writes c = x + r * beta to c_out
// and the sign bytes and sums |c| in groups of 256 exactly like tree256_kernel (lane g keeps group
// g's sum), then reduces the group sums with the same shuffle tree (zero padding: the reference's
// tree, see tree256_kernel); pass 2 rewrites c_out[j] = c - (c < 0 ? -s : s) where every lane
// reads back only what it wrote itself.  c_out may alias r.
extern "C" __global__ void sign_feedback_fused_kernel(const float* x, const float* r, float beta,
                                                      int use_beta, float* c_out, u8* packed,
                                                      float* scales, i64 chunk, i64 n) {
    int lane = threadIdx.x & 31;
    i64 nchunks = (n + chunk - 1) / chunk;
    i64 G = (chunk + 255) / 256;
    for (i64 c = global_warp(); c < nchunks; c += grid_warps()) {  // warp-uniform
        i64 a = c * chunk, len = min(chunk, n - a);
        float mine = 0.0f;
        for (i64 g = 0; g < G; ++g) {
            i64 first = g * 256 + lane * 8;
            float v[8], xv[8], rv[8];
            u32 byte = 0;
            load8(x + a, first, len, xv);
            load8(r + a, first, len, rv);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float cj = 0.0f;
                if (first + e < len) {
                    cj = use_beta ? __fadd_rn(xv[e], __fmul_rn(rv[e], beta)) : __fadd_rn(xv[e], rv[e]);
                    if (!(cj < 0.0f)) byte |= 1u << e;
                }
                xv[e] = cj;
                v[e] = fabsf(cj);
            }
            store8(c_out + a, first, len, xv);
            if (first < len) packed[(a + first) >> 3] = (u8)byte;
            float s = __shfl_sync(FULL, warp_tree256(v, lane), 0);
            if (lane == g) mine = s;
        }
        for (int o = 1; o < 32; o <<= 1) {
            float other = __shfl_down_sync(FULL, mine, o);
            if ((lane & (2 * o - 1)) == 0) mine = __fadd_rn(mine, other);
        }
        float s = __fdiv_rn(__shfl_sync(FULL, mine, 0), (float)len);
        if (s == __int_as_float(INF_KEY)) {  // warp-uniform: sign_rescue_kernel's rescue, on c_out
            __syncwarp();  // c_out as every lane wrote it
            int m = 0;
            for (i64 j = lane; j < len; j += 32) m = max(m, __float_as_int(c_out[a + j]) & ABS_MASK);
            for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
            if (m < INF_KEY) {
                float part = 0.0f;
                for (i64 g = 0; g < G; ++g) {
                    i64 first = g * 256 + lane * 8;
                    float v[8];
                    load8(c_out + a, first, len, v);
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = first + e < len ? __fmul_rn(fabsf(v[e]), SIGN_DOWN) : 0.0f;
                    float t = __shfl_sync(FULL, warp_tree256(v, lane), 0);
                    if (lane == g) part = t;
                }
                for (int o = 1; o < 32; o <<= 1) {
                    float other = __shfl_down_sync(FULL, part, o);
                    if ((lane & (2 * o - 1)) == 0) part = __fadd_rn(part, other);
                }
                s = sign_rescued(__shfl_sync(FULL, part, 0), len);
            }
        }
        if (lane == 0) scales[c] = s;
        for (i64 g = 0; g < G; ++g) {
            i64 first = g * 256 + lane * 8;
            float cv[8];
            load8(c_out + a, first, len, cv);
            for (int e = 0; e < 8; ++e) cv[e] = __fsub_rn(cv[e], cv[e] < 0.0f ? -s : s);
            store8(c_out + a, first, len, cv);
        }
    }
}
