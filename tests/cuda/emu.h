// A CUDA emulator for tests on machines without a GPU: a kernel source (kernels/*.cu) is
// compiled as host C++ with this header in front, and every CUDA thread of a launch runs as a
// fiber of its own.  Blocks run one after another; within a block the fibers run in turn until
// each one exits or stops at a warp shuffle, a warp sync or __syncthreads, and the scheduler
// resolves those (the values of a shuffle are exchanged once every lane of its mask is there).
//
// What it checks that a GPU would not report: a shuffle whose mask names a lane that has
// exited or does not exist, lanes that disagree on a mask, lanes split between a barrier and a
// shuffle (a deadlock; threads that have exited count as arrived at a barrier, as on Volta and
// later), launch configurations CUDA refuses, misaligned loads (kernels/common.cuh traps on
// them in these builds), reads or writes past an allocation (tests/cuda/fake/cupy.py ends each
// one at a guard page; the fault is reported, not fatal), and (tests/cuda/emulator.py) launch
// arguments whose size or kind differ from the kernel's parameters.
//
// Performance is not a goal: it runs the kernels' own arithmetic, in the kernels' own order.
#pragma once

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <ucontext.h>

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

#ifndef __global__  // (tests/cuda/emulator.py sets it to a marker to find the kernels' names)
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // one block runs at a time, so a block's shared memory can be static
#define __launch_bounds__(...)

namespace emu {

enum State { READY, SHUFFLE, WARP_SYNC, BARRIER, DONE };

// Switching fibers: on x86-64 a plain stack switch (six callee-saved registers; no signal mask
// system calls, which made ucontext's swapcontext the bulk of the time); ucontext elsewhere.
#if defined(__x86_64__)
extern "C" __attribute__((visibility("hidden"))) void emu_switch(void **save_sp, void *next_sp);
__asm__(".text\n.globl emu_switch\n.hidden emu_switch\n.type emu_switch,@function\nemu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
        ".size emu_switch, .-emu_switch\n");
struct Context {
    void *sp = nullptr;
};
inline void switch_to(Context &from, Context &to) { emu_switch(&from.sp, to.sp); }
inline void start_context(Context &c, char *stack, size_t size, void (*entry)()) {
    // the first switch pops six registers, then "returns" into entry with the stack aligned as
    // after a call (rsp % 16 == 8); entry never returns
    uintptr_t top = ((uintptr_t)(stack + size) & ~(uintptr_t)15) - 16;
    void **sp = (void **)top;
    *sp = (void *)entry;
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_to(Context &from, Context &to) { swapcontext(&from.uc, &to.uc); }
inline void start_context(Context &c, char *stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
    Context ctx;
    uint3 tid;
    int lane = 0;
    State state = READY;
    unsigned mask = 0;
    int src = 0;
    uint64_t value = 0, result = 0;
};

struct Launch {
    dim3 grid{1, 1, 1}, block{1, 1, 1};
    uint3 bid{0, 0, 0};
    std::vector<Fiber> fibers;
    char *stacks = nullptr;  // STACK_BYTES per thread of a block (stack_pool)
    Fiber *cur = nullptr;
    Context sched;
    void (*invoke)(void *fn, void **args) = nullptr;
    void *fn = nullptr;
    void **args = nullptr;
    std::string error;
};

inline thread_local Launch *L = nullptr;
constexpr size_t STACK_BYTES = 64 * 1024;

// The fibers' stacks, kept from launch to launch and never cleared (a decode step makes hundreds
// of launches of 128 threads: 8 MB of zeroed stacks each took longer than the kernels)
inline char *stack_pool(size_t bytes) {
    static thread_local std::unique_ptr<char[]> pool;
    static thread_local size_t size = 0;
    if (size < bytes) {
        pool.reset(new char[bytes]);
        size = bytes;
    }
    return pool.get();
}

inline void yield() { switch_to(L->cur->ctx, L->sched); }

inline void fiber_main() {
    L->invoke(L->fn, L->args);
    L->cur->state = DONE;
    yield();
    __builtin_unreachable();
}

template <class T>
inline T exchange(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Fiber *f = L->cur;
    f->value = 0;
    std::memcpy(&f->value, &v, sizeof(T));
    f->mask = mask;
    f->src = src;
    f->state = SHUFFLE;
    yield();
    T r;
    std::memcpy(&r, &f->result, sizeof(T));
    return r;
}

inline std::string lane_name(const Launch &l, size_t i) {
    char buf[160];
    const Fiber &f = l.fibers[i];
    std::snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z, l.bid.x,
                  l.bid.y, l.bid.z);
    return buf;
}

// One warp whose lanes wait at a shuffle or warp sync: exchange the values once every lane of
// the mask is there.  Returns false while some lane of the mask still has to arrive.
inline bool resolve_warp(Launch &l, size_t first, size_t n) {
    size_t waiting = first + n;
    for (size_t i = first; i < first + n; ++i) {
        if (l.fibers[i].state == SHUFFLE || l.fibers[i].state == WARP_SYNC) { waiting = i; break; }
    }
    if (waiting == first + n) return false;
    const unsigned mask = l.fibers[waiting].mask;
    for (int lane = 0; lane < 32; ++lane) {
        if (!(mask >> lane & 1)) continue;
        if ((size_t)lane >= n) {
            l.error = "a warp shuffle's mask names lane " + std::to_string(lane) + ", which this block of " +
                      std::to_string(l.fibers.size()) + " threads does not have (" + lane_name(l, waiting) + ")";
            return false;
        }
        const Fiber &f = l.fibers[first + lane];
        if (f.state == DONE) {
            l.error = "lane " + std::to_string(lane) + " has exited before a warp shuffle whose mask names it (" +
                      lane_name(l, waiting) + ")";
            return false;
        }
        if (f.state != SHUFFLE && f.state != WARP_SYNC) return false;
        if (f.mask != mask) {
            l.error = "lanes of one warp shuffle disagree on its mask (" + lane_name(l, first + lane) + ")";
            return false;
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        if (!(mask >> lane & 1)) continue;
        Fiber &f = l.fibers[first + lane];
        if (f.state == SHUFFLE) {
            if (!(mask >> f.src & 1)) {
                l.error = "a shuffle reads lane " + std::to_string(f.src) + ", which is not in its mask (" +
                          lane_name(l, first + lane) + ")";
                return false;
            }
            f.result = l.fibers[first + f.src].value;
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        if (mask >> lane & 1) l.fibers[first + lane].state = READY;
    }
    return true;
}

inline bool resolve(Launch &l) {
    bool progress = false;
    const size_t n = l.fibers.size();
    for (size_t w = 0; w < n && l.error.empty(); w += 32) progress |= resolve_warp(l, w, std::min<size_t>(32, n - w));
    if (!l.error.empty()) return false;
    size_t live = 0, at_barrier = 0;
    for (const Fiber &f : l.fibers) {
        live += f.state != DONE;
        at_barrier += f.state == BARRIER;
    }
    if (live && at_barrier == live) {
        for (Fiber &f : l.fibers) f.state = f.state == BARRIER ? READY : f.state;
        progress = true;
    }
    return progress;
}

inline bool run_block(Launch &l) {
    const unsigned nx = l.block.x, ny = l.block.y;
    for (size_t i = 0; i < l.fibers.size(); ++i) {
        Fiber &f = l.fibers[i];
        f.tid = {(unsigned)(i % nx), (unsigned)(i / nx % ny), (unsigned)(i / (nx * ny))};
        f.lane = (int)(i % 32);
        f.state = READY;
        start_context(f.ctx, l.stacks + i * STACK_BYTES, STACK_BYTES, fiber_main);
    }
    for (;;) {
        bool live = false;
        for (Fiber &f : l.fibers) {
            if (f.state == READY) {
                l.cur = &f;
                switch_to(l.sched, f.ctx);
            }
            live |= f.state != DONE;
        }
        if (!live) return true;
        if (!resolve(l)) {
            if (l.error.empty()) {
                l.error = "deadlock: threads wait at __syncthreads or a warp shuffle that the others never reach";
            }
            return false;
        }
    }
}

// a kernel's metadata and a type-erased call with its arguments (void *args[], as cuLaunchKernel)
struct Kernel {
    const char *name;
    void *fn;
    void (*invoke)(void *fn, void **args);
    std::vector<int> arg_sizes;
    std::vector<char> arg_kinds;  // 'p' pointer, 'i' integer, 'f' floating point
};

template <class A>
constexpr char kind_of() {
    return std::is_pointer<A>::value ? 'p' : std::is_floating_point<A>::value ? 'f' : 'i';
}

template <class... A, size_t... I>
void call(void (*f)(A...), void **args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>> *>(args[I])...);
}

template <class... A>
Kernel make_kernel(const char *name, void (*f)(A...)) {
    Kernel k;
    k.name = name;
    k.fn = (void *)f;
    k.invoke = [](void *fn, void **args) { call((void (*)(A...))fn, args, std::index_sequence_for<A...>{}); };
    k.arg_sizes = {(int)sizeof(A)...};
    k.arg_kinds = {kind_of<A>()...};
    return k;
}

}  // namespace emu

#define threadIdx (::emu::L->cur->tid)
#define blockIdx (::emu::L->bid)
#define blockDim (::emu::L->block)
#define gridDim (::emu::L->grid)
#define warpSize 32

// -- device functions and intrinsics the kernels use ------------------------------------------

inline void __syncthreads() {
    ::emu::L->cur->state = ::emu::BARRIER;
    ::emu::yield();
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ::emu::Fiber *f = ::emu::L->cur;
    f->mask = mask;
    f->state = ::emu::WARP_SYNC;
    ::emu::yield();
}

// the source lane, as CUDA computes it for a shuffle within segments of `width` lanes
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = ::emu::L->cur->lane;
    return ::emu::exchange(mask, v, (lane / width) * width + (src % width));
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = ::emu::L->cur->lane, src = lane ^ lane_mask;
    return ::emu::exchange(mask, v, src >= (lane / width + 1) * width ? lane : src);
}

template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = ::emu::L->cur->lane, src = lane + (int)delta;
    return ::emu::exchange(mask, v, src >= (lane / width + 1) * width ? lane : src);
}

template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = ::emu::L->cur->lane, src = lane - (int)delta;
    return ::emu::exchange(mask, v, src < (lane / width) * width ? lane : src);
}

inline int __dp4a(int a, int b, int c) {
    for (int j = 0; j < 4; ++j) c += (int)(signed char)(a >> (8 * j)) * (int)(signed char)(b >> (8 * j));
    return c;
}

inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }  // the default mode: to nearest even
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's integer min and max (device built-ins; the host's are std::min / std::max)
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
template <class T> inline T __ldg(const T *p) { return *p; }
template <class T> inline T atomicAdd(T *p, T v) { const T old = *p; *p = old + v; return old; }  // blocks run in turn
template <class T> inline T atomicMax(T *p, T v) { const T old = *p; *p = old > v ? old : v; return old; }

using std::fabs;
using std::fmax;
using std::fmin;

// -- the module's exports (the generated file lists the kernels, then says EMU_EXPORTS) --------

namespace emu {
inline sigjmp_buf fault_jump;
inline void *fault_address = nullptr;
inline int fault_signal = 0;
inline void on_fault(int sig, siginfo_t *info, void *) {
    fault_address = info->si_addr;
    fault_signal = sig;
    siglongjmp(fault_jump, 1);
}
}  // namespace emu

#define EMU_EXPORTS                                                                                   \
extern "C" int emu_kernel_count() { return (int)(sizeof(emu_kernels) / sizeof(emu_kernels[0])); }   \
extern "C" const char *emu_kernel_name(int i) { return emu_kernels[i].name; }                       \
extern "C" int emu_kernel_nargs(int i) { return (int)emu_kernels[i].arg_sizes.size(); }             \
extern "C" int emu_kernel_arg_size(int i, int j) { return emu_kernels[i].arg_sizes[j]; }           \
extern "C" char emu_kernel_arg_kind(int i, int j) { return emu_kernels[i].arg_kinds[j]; }          \
/* Run kernel i on grid x block; 0, or 1 with a message in err (a segmentation fault inside the  \
   kernel, e.g. a read past a guarded allocation, is reported, not fatal) */                      \
extern "C" int emu_launch(int i, const unsigned *grid, const unsigned *block, void **args, char *err, \
                          int err_size) {                                                          \
    emu::Launch l;                                                                                 \
    l.grid = {grid[0], grid[1], grid[2]};                                                          \
    l.block = {block[0], block[1], block[2]};                                                      \
    l.invoke = emu_kernels[i].invoke;                                                              \
    l.fn = emu_kernels[i].fn;                                                                      \
    l.args = args;                                                                                 \
    const size_t threads = (size_t)block[0] * block[1] * block[2];                                 \
    l.fibers.resize(threads);                                                                      \
    l.stacks = emu::stack_pool(threads * emu::STACK_BYTES);                                        \
    emu::Launch *saved = emu::L;                                                                   \
    emu::L = &l;                                                                                   \
    struct sigaction act{}, old_segv{}, old_bus{}, old_ill{};                                      \
    act.sa_sigaction = emu::on_fault;                                                              \
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;                                                        \
    sigemptyset(&act.sa_mask);                                                                     \
    sigaction(SIGSEGV, &act, &old_segv);                                                           \
    sigaction(SIGBUS, &act, &old_bus);                                                             \
    sigaction(SIGILL, &act, &old_ill);                                                             \
    volatile bool ok = false;                                                                      \
    if (sigsetjmp(emu::fault_jump, 1) == 0) {                                                      \
        ok = true;                                                                                 \
        for (unsigned z = 0; z < grid[2] && ok; ++z)                                               \
            for (unsigned y = 0; y < grid[1] && ok; ++y)                                           \
                for (unsigned x = 0; x < grid[0] && ok; ++x) {                                     \
                    l.bid = {x, y, z};                                                             \
                    ok = emu::run_block(l);                                                        \
                }                                                                                  \
    } else {                                                                                       \
        char buf[128];                                                                             \
        if (emu::fault_signal == SIGILL)                                                           \
            std::snprintf(buf, sizeof buf, "misaligned load (a trap in kernels/common.cuh) in ");  \
        else                                                                                       \
            std::snprintf(buf, sizeof buf, "memory fault at address %p in ", emu::fault_address);  \
        l.error = buf + emu::lane_name(l, (size_t)(l.cur - l.fibers.data()));                     \
    }                                                                                              \
    sigaction(SIGSEGV, &old_segv, nullptr);                                                        \
    sigaction(SIGBUS, &old_bus, nullptr);                                                          \
    sigaction(SIGILL, &old_ill, nullptr);                                                          \
    emu::L = saved;                                                                                \
    if (!l.error.empty()) {                                                                        \
        std::snprintf(err, (size_t)err_size, "%s", l.error.c_str());                              \
        return 1;                                                                                  \
    }                                                                                              \
    return 0;                                                                                      \
}
