// Runs the kernels that use barriers, warp shuffles, ballots or atomics under ThreadSanitizer
// (built by `python kernels/host/build.py --tsan-driver`, run by kernels/host_check.sh).
// A data race makes TSan fail the run; the few results checked here guard against a driver
// that launches nothing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" int cuhost_launch(const char* name, long long grid, int threads, void** args);

typedef long long i64;

static int failures = 0;

template <typename... T>
static void run(const char* name, long long grid, int threads, T... params) {
    void* args[] = {static_cast<void*>(params)..., nullptr};
    int rc = cuhost_launch(name, grid, threads, args);
    if (rc) {
        std::fprintf(stderr, "tsan_driver: %s returned %d\n", name, rc);
        ++failures;
    }
}

static void expect(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "tsan_driver: wrong result: %s\n", what);
        ++failures;
    }
}

int main() {
    const i64 n = 3000, seg = 256, nseg = (n + seg - 1) / seg;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::vector<float> x(n);
    for (auto& v : x) v = normal(rng);
    x[10] = x[20] = x[30];  // ties
    std::vector<int> xi(n), keys(n);
    std::memcpy(xi.data(), x.data(), n * 4);
    for (i64 j = 0; j < n; ++j) keys[j] = xi[j] & 0x7fffffff;
    int threads = 64;
    long long grid = 2;

    // radix select of the k-th largest key, then the selection it describes
    i64 k = 97;
    std::vector<i64> state(6, -7);  // the first pass must not read it
    std::vector<i64> hist(3 * 2048, 0);
    int shifts[3] = {20, 10, 0}, bits[3] = {11, 10, 10};
    for (int p = 0; p < 3; ++p) {
        i64* h = hist.data() + p * 2048;
        int first = p == 0, last = p == 2;
        const int* xp = xi.data();
        i64* sp = state.data();
        run("radix_hist", grid, threads, &xp, (void*)&n, &sp, &first, &shifts[p], &bits[p], &h);
        run("radix_pick", 1, 32, &h, &bits[p], &first, &last, &k, &sp);
    }
    std::vector<int> sorted = keys;
    std::sort(sorted.begin(), sorted.end(), std::greater<int>());
    expect(state[0] == sorted[k - 1], "radix select finds the k-th key");

    // the top-k selection (sel on the device), then a threshold selection (sel = NULL, lo, hi)
    const int* xp = xi.data();
    for (int threshold = 0; threshold < 2; ++threshold) {
        i64* sel = threshold ? nullptr : state.data() + 2;
        i64 lo = 0x3f800000 - 1, hi = 0x7f800000;  // |x| >= 1.0
        std::vector<i64> counts(2 * nseg), incl(2 * nseg);
        i64* cp = counts.data();
        run("sel_count", grid, threads, &xp, (void*)&n, (void*)&seg, &sel, &lo, &hi, &cp);
        for (int row = 0; row < 2; ++row) {
            i64 acc = 0;
            for (i64 s = 0; s < nseg; ++s) incl[row * nseg + s] = acc += counts[row * nseg + s];
        }
        i64 total = threshold ? incl[nseg - 1] : k;
        std::vector<int> idx(total), val(total), res(n);
        for (int mode : {1, 2}) {
            if (mode == 1) res = xi;
            i64* ip2 = incl.data();
            int* ip = idx.data();
            int* vp = val.data();
            int* rp = res.data();
            run("sel_write_i32", grid, threads, &xp, (void*)&n, (void*)&seg, &sel, &lo, &hi, &cp, &ip2, &ip,
                &vp, &rp, &mode);
        }
        expect(std::is_sorted(idx.begin(), idx.end()), "selected indices ascending");
        expect(threshold || (i64)idx.size() == k, "top-k selects k");
    }

    // block absmax with sub-warp groups and with full warps, and its per-block factor
    for (i64 block : {5, 64}) {
        i64 nblocks = (n + block - 1) / block;
        int width = block >= 32 ? 32 : 8, qmax = 7;
        std::vector<float> scales(nblocks), inv(nblocks);
        float* sp = scales.data();
        float* vp = inv.data();
        run("block_absmax_kernel", grid, threads, &xp, &sp, &vp, &qmax, (void*)&n, &block, &nblocks, &width);
        float m = 0;
        for (i64 j = 0; j < std::min(block, n); ++j) m = std::max(m, std::fabs(x[j]));
        expect(scales[0] == m, "absmax of block 0");
    }

    // the pairwise tree of sign scales: two levels (chunk 3000 = 12 groups of 256)
    {
        i64 chunk = n, nchunks = 1, groups = (chunk + 255) / 256, size2 = groups;
        std::vector<float> partial(groups), scale(1);
        const float* in = x.data();
        float* pp = partial.data();
        int absval = 1, fin = 0;
        run("tree256_kernel", grid, threads, &in, &pp, (void*)&n, &chunk, &nchunks, &absval, &fin, &chunk,
            (void*)&n);
        const float* in2 = partial.data();
        float* sp = scale.data();
        absval = 0;
        fin = 1;
        run("tree256_kernel", grid, threads, &in2, &sp, &size2, &groups, &nchunks, &absval, &fin, &chunk,
            (void*)&n);
        expect(scale[0] > 0.5f && scale[0] < 1.0f, "mean |x| of a normal sample");
    }

    // the QSGD norm rescue: squares that overflow fp32, a warp per bucket (three groups of 256)
    {
        std::vector<float> big(n), norms(5, -1.0f);
        for (i64 j = 0; j < n; ++j) big[j] = x[j] * 1e20f;
        const float* in = big.data();
        float* np_ = norms.data();
        i64 bucket = 600, nb = 5;
        run("norm_rescue_kernel", grid, threads, &in, &np_, (void*)&n, &bucket, &nb);
        double s = 0;
        for (i64 j = 0; j < bucket; ++j) s += (double)big[j] * big[j];
        expect(std::fabs(norms[0] / std::sqrt(s) - 1) < 1e-5, "rescued norm of bucket 0");
    }

    // fp8 (sub-warp groups and full warps) and MX (a warp per block, codes packed by shuffles)
    {
        int mbits = 3, emin = -6, sbit = 128, fmax_key = 0x43e00000, sto = 1;  // e4m3, max 448
        unsigned k0 = 1, k1 = 2;
        for (i64 block : {5, 128}) {
            i64 nblocks = (n + block - 1) / block;
            int width = block >= 32 ? 32 : 8;
            std::vector<unsigned char> codes(n);
            std::vector<float> scales(nblocks);
            const float* in = x.data();
            unsigned char* cp = codes.data();
            float* sp = scales.data();
            run("fp8_quantize_kernel", grid, threads, &in, &cp, &sp, (void*)&n, &block, &nblocks, &width,
                &mbits, &emin, &sbit, &fmax_key, &sto, &k0, &k1);
            float m = 0;
            for (i64 j = 0; j < block; ++j) m = std::max(m, std::fabs(x[j]));
            expect(scales[0] == m / 448.0f, "fp8 scale of block 0");
        }
        int bits = 4, emax = 2, fmin_key = 0x40c00000;  // fp4 e2m1, max 6
        mbits = 1;
        emin = 0;
        sbit = 8;
        i64 nbytes = (n * bits + 7) / 8;
        std::vector<unsigned char> packed(nbytes), sbytes((n + 31) / 32);
        const float* in = x.data();
        unsigned char* pp = packed.data();
        unsigned char* sp = sbytes.data();
        run("mx_quantize_kernel", grid, threads, &in, &pp, &sp, (void*)&n, &nbytes, &bits, &emax, &mbits,
            &emin, &sbit, &fmin_key, &sto, &k0, &k1);
        expect(sbytes[0] > 100 && sbytes[0] < 140, "MX scale byte of block 0");
    }

    // signsgd error feedback in one pass (a warp per chunk, shuffle trees)
    {
        i64 chunk = 1024, nchunks = (n + chunk - 1) / chunk;
        std::vector<float> r(n, 0.5f), c(n), scales(nchunks);
        std::vector<unsigned char> packed((n + 7) / 8);
        const float* in = x.data();
        const float* rp = r.data();
        float beta = 0.5f, *cp = c.data(), *sp = scales.data();
        int use_beta = 1;
        unsigned char* pp = packed.data();
        run("sign_feedback_fused_kernel", grid, threads, &in, &rp, &beta, &use_beta, &cp, &pp, &sp, &chunk,
            (void*)&n);
        expect(scales[0] > 0.5f && scales[0] < 1.5f, "mean |x + r/2| of a normal sample");
    }

    // scatter-add with duplicate indices: compare-and-swap, no lost update
    {
        i64 m = 4096;
        std::vector<i64> sidx(m);
        std::vector<float> out(8, 0.0f), sval(m, 1.0f);
        for (i64 j = 0; j < m; ++j) sidx[j] = j % 8;
        int bad = 0;
        const i64* ip = sidx.data();
        int* bp = &bad;
        float* op = out.data();
        const float* vp = sval.data();
        run("scatter_check", grid, threads, &ip, &m, (void*)&n, &bp);
        run("scatter_add_f32", grid, threads, &op, &ip, &vp, &m, &bp);
        expect(bad == 0 && out[0] == 512.0f && out[7] == 512.0f, "duplicates all added");
    }

    // scatter check (atomic flag) + all-or-nothing add
    {
        std::vector<i64> sidx = {1, 5, n + 3};
        std::vector<float> out(n, 1.0f), sval = {1, 2, 3};
        int bad = 0;
        i64 m = 3;
        const i64* ip = sidx.data();
        int* bp = &bad;
        float* op = out.data();
        const float* vp = sval.data();
        run("scatter_check", grid, threads, &ip, &m, (void*)&n, &bp);
        run("scatter_add_f32", grid, threads, &op, &ip, &vp, &m, &bp);
        expect(bad == 1 && out[1] == 1.0f, "bad index: nothing written");
    }

    if (failures) return 1;
    std::printf("tsan_driver: ok (radix select, selection, absmax, tree, norm rescue, fp8, MX, sign feedback, scatter under TSan)\n");
    return 0;
}
