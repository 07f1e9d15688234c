// Host shim: compiles kernels/*.cu as plain C++ so CI (no GPU) can run them.
//
// One launch runs every block of the grid in turn, with one execution context per CUDA thread of
// the block, so __syncthreads, warp shuffles and ballots are real barriers: no thread passes one
// before every thread it names has arrived.  Two ways to run those contexts:
//  * fibers (the default): user-space contexts (ucontext) on the launching thread, switched only
//    at barriers.  A barrier costs a few context switches instead of waking 64 kernel threads on
//    two cores; each pass over the waiting fibers runs them in a different order (a seeded
//    permutation), so a kernel whose result depends on the order of threads between barriers
//    (a missing barrier) does not pass by luck of one fixed order;
//  * std::threads, from a pool kept between launches (built with -fsanitize=thread, or with
//    -DCUHOST_THREADS): what ThreadSanitizer checks for data races (kernels/host/tsan_driver.cpp).
// __shared__ becomes `static` (one block runs at a time; launches are serialized).  Only what the
// kernels use is mapped: 1-D grids, blockDim.x a multiple of 32, full-warp masks, integer atomics
// and compare-and-swap.  fp32 math is plain C++ (build with -ffp-contract=off, no -ffast-math):
// IEEE round to nearest, subnormals kept, which is what the __f*_rn intrinsics and NVRTC's default
// -ftz=false give.
#pragma once

#include <algorithm>
#include <cmath>
#include <math.h>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_THREAD__) && !defined(CUHOST_THREADS)
#define CUHOST_THREADS 1
#endif
#ifndef CUHOST_THREADS
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace cuhost {

#ifndef CUHOST_THREADS
inline void fiber_yield();  // back to the scheduler: another fiber runs (defined below)
// Arrivals at barriers and finished threads of the running launch: a pass of the scheduler that
// adds none finds every fiber waiting at a barrier that cannot open (a deadlock).
inline thread_local unsigned long long tl_progress = 0;
#endif

// A reusable barrier for a fixed number of threads.  Threads: mutex + condition variable
// (TSan-visible; sleeping waiters leave the cores to the threads still running, there being more
// than cores).  Fibers: a waiter yields until the last arrival has opened the barrier.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
#ifdef CUHOST_THREADS
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    unsigned gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen != gen_; });
    }
  }
#else
  void wait() {
    unsigned gen = gen_;
    ++tl_progress;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      return;
    }
    while (gen == gen_) fiber_yield();
  }
#endif

 private:
#ifdef CUHOST_THREADS
  std::mutex m_;
  std::condition_variable cv_;
#endif
  const int n_;
  int count_ = 0;
  unsigned gen_ = 0;
};

struct Block {
  explicit Block(int threads) : bar(threads), slots(threads) {
    for (int w = 0; w < threads / 32; ++w) warp_bars.emplace_back(new Barrier(32));
  }
  ~Block() {
    for (Barrier* b : warp_bars) delete b;
  }
  Barrier bar;
  std::vector<Barrier*> warp_bars;
  std::vector<uint64_t> slots;  // one exchange word per thread, for shuffles and ballots
};

inline thread_local dim3 tl_thread, tl_block, tl_block_dim, tl_grid_dim;
inline thread_local Block* tl_blk = nullptr;

inline int lane_id() { return (int)(tl_thread.x & 31u); }

// Every lane publishes a 64-bit word, then reads lane `src` (its own word when src is out of range).
inline uint64_t warp_exchange(uint64_t mine, int src) {
  int lane = lane_id();
  unsigned base = tl_thread.x - (unsigned)lane;
  Barrier* wb = tl_blk->warp_bars[tl_thread.x >> 5];
  tl_blk->slots[tl_thread.x] = mine;
  wb->wait();
  uint64_t got = (src >= 0 && src < 32) ? tl_blk->slots[base + (unsigned)src] : mine;
  wb->wait();  // nobody overwrites its slot before every lane has read
  return got;
}

template <typename T>
inline uint64_t to_word(T v) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 64 bits");
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(T));
  return w;
}

template <typename T>
inline T from_word(uint64_t w) {
  T v;
  std::memcpy(&v, &w, sizeof(T));
  return v;
}

inline unsigned ballot(bool pred) {
  int lane = lane_id();
  unsigned base = tl_thread.x - (unsigned)lane;
  Barrier* wb = tl_blk->warp_bars[tl_thread.x >> 5];
  tl_blk->slots[tl_thread.x] = pred ? 1u : 0u;
  wb->wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (unsigned)tl_blk->slots[base + l] << l;
  wb->wait();
  return bits;
}

#ifdef CUHOST_THREADS
// The host threads that play the CUDA threads, kept between launches (creating 64 threads per
// launch costs more than most kernels).  Worker t runs thread t of every block of a launch.
// Not fork-safe: a forked child must not launch (the tests never fork after loading the library).
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& th : workers_) th.join();
  }

  // Runs `body` for every (block, thread) of a 1-D launch; returns after all finished.
  void run(unsigned grid, unsigned threads, const std::function<void()>& body) {
    std::lock_guard<std::mutex> serial(launch_mutex_);  // one launch at a time (static __shared__)
    Block blk((int)threads);
    std::unique_lock<std::mutex> lock(m_);
    while (workers_.size() < threads) {
      unsigned id = (unsigned)workers_.size();
      workers_.emplace_back([this, id] { work(id); });
    }
    job_ = Job{grid, threads, &body, &blk};
    running_ = threads;
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  struct Job {
    unsigned grid = 0, threads = 0;
    const std::function<void()>* body = nullptr;
    Block* blk = nullptr;
  };

  void work(unsigned id) {
    unsigned seen = 0;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      if (id >= job.threads) continue;
      tl_thread.x = id;
      tl_block_dim.x = job.threads;
      tl_grid_dim.x = job.grid;
      tl_blk = job.blk;
      for (unsigned b = 0; b < job.grid; ++b) {
        tl_block.x = b;
        (*job.body)();
        job.blk->bar.wait();  // shared memory of block b is dead before block b+1 starts
      }
      std::lock_guard<std::mutex> lock(m_);
      if (--running_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex launch_mutex_, m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  Job job_;
  unsigned generation_ = 0, running_ = 0;
  bool stop_ = false;
};

template <typename F>
bool launch(unsigned grid, unsigned threads, F body) {
  static Pool pool;
  pool.run(grid, threads, std::function<void()>(body));
  return true;
}
#else
// The fibers that play the CUDA threads of one block, on the thread that launches.  Each has its
// own stack (kept between launches, a guard page below it: an overflow faults instead of
// corrupting a neighbour).  The scheduler resumes every unfinished fiber once per pass, in an
// order drawn anew for each pass; a fiber runs until it waits at a barrier or returns.  A pass in
// which no fiber arrived at a barrier or returned is a deadlock (threads that wait at a barrier
// some others never reach, e.g. after an early return): the launch is abandoned and reported
// (the threads build would hang there).
class Fibers {
 public:
  static constexpr size_t kStack = 256 * 1024;

  ~Fibers() {
    for (Fiber& f : fibers_) munmap(f.mem, f.size);
  }

  // Returns false when a block deadlocked (the rest of the launch is not run).
  bool run(unsigned grid, unsigned threads, const std::function<void()>& body) {
    std::lock_guard<std::mutex> serial(launch_mutex_);  // one launch at a time (static __shared__)
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    while (fibers_.size() < threads) {
      Fiber f;
      f.size = kStack + page;
      f.mem = mmap(nullptr, f.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (f.mem == MAP_FAILED) throw std::bad_alloc();
      mprotect(f.mem, page, PROT_NONE);  // the stack grows down into this page: a fault
      fibers_.push_back(f);
    }
    order_.resize(threads);
    body_ = &body;
    current_ = this;
    for (unsigned b = 0; b < grid; ++b) {
      Block blk((int)threads);
      tl_blk = &blk;
      tl_block.x = b;
      tl_block_dim.x = threads;
      tl_grid_dim.x = grid;
      for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = fibers_[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = (char*)f.mem + page;
        f.ctx.uc_stack.ss_size = f.size - page;
        f.ctx.uc_link = &sched_;
        makecontext(&f.ctx, &Fibers::entry, 0);
        f.done = false;
      }
      unsigned live = threads;
      while (live) {
        const unsigned long long before = tl_progress;
        shuffle(threads);
        for (unsigned i = 0; i < threads; ++i) {
          unsigned t = order_[i];
          Fiber& f = fibers_[t];
          if (f.done) continue;
          tl_thread.x = t;
          running_ = &f;
          swapcontext(&sched_, &f.ctx);
          if (f.done) --live;
        }
        if (live && tl_progress == before) {  // every live fiber waits at a barrier that cannot open
          tl_blk = nullptr;
          current_ = nullptr;
          return false;
        }
      }
      tl_blk = nullptr;
    }
    current_ = nullptr;
    return true;
  }

  void yield() { swapcontext(&running_->ctx, &sched_); }

  static Fibers* current() { return current_; }

 private:
  struct Fiber {
    ucontext_t ctx;
    void* mem = nullptr;
    size_t size = 0;
    bool done = true;
  };

  static void entry() {
    Fibers* self = current_;
    (*self->body_)();
    self->running_->done = true;  // returning resumes uc_link: the scheduler
    ++tl_progress;
  }

  // A new order of the fibers for the next pass (xorshift; the same sequence in every process).
  void shuffle(unsigned n) {
    for (unsigned i = 0; i < n; ++i) order_[i] = i;
    for (unsigned i = n; i > 1; --i) {
      seed_ ^= seed_ << 13;
      seed_ ^= seed_ >> 7;
      seed_ ^= seed_ << 17;
      std::swap(order_[i - 1], order_[seed_ % i]);
    }
  }

  static inline thread_local Fibers* current_ = nullptr;
  std::mutex launch_mutex_;
  std::vector<Fiber> fibers_;
  std::vector<unsigned> order_;
  const std::function<void()>* body_ = nullptr;
  Fiber* running_ = nullptr;
  ucontext_t sched_;
  uint64_t seed_ = 0x9e3779b97f4a7c15ull;
};

inline void fiber_yield() { Fibers::current()->yield(); }

// false: a block deadlocked at a barrier (see Fibers)
template <typename F>
bool launch(unsigned grid, unsigned threads, F body) {
  static Fibers fibers;
  return fibers.run(grid, threads, std::function<void()>(body));
}
#endif


}  // namespace cuhost

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define threadIdx (cuhost::tl_thread)
#define blockIdx (cuhost::tl_block)
#define blockDim (cuhost::tl_block_dim)
#define gridDim (cuhost::tl_grid_dim)

inline void __syncthreads() { cuhost::tl_blk->bar.wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuhost::ballot(false); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  return cuhost::from_word<T>(cuhost::warp_exchange(cuhost::to_word(v), src & 31));
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta) {
  return cuhost::from_word<T>(cuhost::warp_exchange(cuhost::to_word(v), cuhost::lane_id() + (int)delta));
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
  return cuhost::from_word<T>(cuhost::warp_exchange(cuhost::to_word(v), cuhost::lane_id() - (int)delta));
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return cuhost::from_word<T>(cuhost::warp_exchange(cuhost::to_word(v), cuhost::lane_id() ^ mask));
}
inline unsigned __ballot_sync(unsigned, int pred) { return cuhost::ballot(pred != 0); }
// Lanes holding the same value as this lane (sm_70+).
template <typename T>
inline unsigned __match_any_sync(unsigned, T v) {
  static_assert(sizeof(T) <= 8, "match of a type wider than 64 bits");
  int lane = cuhost::lane_id();
  unsigned base = cuhost::tl_thread.x - (unsigned)lane;
  cuhost::Barrier* wb = cuhost::tl_blk->warp_bars[cuhost::tl_thread.x >> 5];
  uint64_t mine = cuhost::to_word(v);
  cuhost::tl_blk->slots[cuhost::tl_thread.x] = mine;
  wb->wait();
  unsigned same = 0;
  for (int l = 0; l < 32; ++l) same |= (unsigned)(cuhost::tl_blk->slots[base + l] == mine) << l;
  wb->wait();
  return same;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }

template <typename T>
inline T atomicAdd(T* p, T v) {
  static_assert(std::is_integral<T>::value, "host shim: integer atomicAdd only");
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
template <typename T>
inline T atomicMax(T* p, T v) {
  T cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return cur;
}
template <typename T>
inline T atomicCAS(T* p, T compare, T value) {
  __atomic_compare_exchange_n(p, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;  // the old value, whether or not the swap happened
}
#define COMMPRESS_HOST 1
inline unsigned load_relaxed(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline unsigned long long load_relaxed(const unsigned long long* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline long long __double_as_longlong(double d) { long long v; std::memcpy(&v, &d, 8); return v; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }

// CUDA's min/max accept mixed integer types; promote like the device overloads do.
template <typename A, typename B>
inline typename std::common_type<A, B>::type min(A a, B b) {
  typedef typename std::common_type<A, B>::type C;
  return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B>
inline typename std::common_type<A, B>::type max(A a, B b) {
  typedef typename std::common_type<A, B>::type C;
  return (C)a < (C)b ? (C)b : (C)a;
}
