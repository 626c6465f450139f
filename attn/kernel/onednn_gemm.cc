// The attention core's three batched products as XLA FFI handlers on oneDNN's
// row-major dnnl_sgemm (float32), read in place from attn's layouts: no
// transposes, no copies. attn/onednn.py builds this file (once per source,
// jaxlib and oneDNN library; cached) and registers the handlers for the CPU.
//
//   attn_onednn_nt  a (B,T,H,D), b (B,S,G,D)  ->  c (B,H,T,S),  c[b,h] = a[b,:,h] · b[b,:,g]ᵀ
//   attn_onednn_nn  a (B,H,T,S), b (B,S,G,D)  ->  c (B,T,H,D),  c[b,:,h] = a[b,h] · b[b,:,g]
//   attn_onednn_tn  a (B,H,T,S), b (B,T,H,D)  ->  c (B,S,G,D),  c[b,:,g] = Σ_{h in g} a[b,h]ᵀ · b[b,:,h]
//
// with g = h / (H / G): G key/value heads shared by H query heads. The three
// close under differentiation (attn/onednn.py's custom VJPs). The (batch, head)
// matrices are handed out one at a time to XLA's own intra-op threads (the FFI
// thread pool; the calling thread works too), each running oneDNN's sgemm on
// one thread: no second thread pool competes with XLA's, and a thread slowed by
// another process only takes fewer matrices.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// oneDNN's C API (dnnl.h, dnnl_types.h): dnnl_dim_t is int64_t, dnnl_status_t an
// enum whose dnnl_success is 0. Declared here so the build needs no oneDNN headers.
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K,
                          float alpha, const float* A, int64_t lda, const float* B,
                          int64_t ldb, float beta, float* C, int64_t ldc);
// GNU OpenMP, which this oneDNN build runs its sgemm on: one thread per call here.
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);

namespace {

// Runs body(i) for i in [0, n) on the calling thread and up to num_threads - 1
// tasks of XLA's pool, an item at a time; returns the items' failures OR-ed.
// Late tasks find no item left and only drop their reference to the state.
template <typename Body>
int ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<int> failed{0};
    std::mutex m;
    std::condition_variable cv;
    int64_t n;
    const Body* body;
  };
  auto st = std::make_shared<State>();
  st->n = n;
  st->body = &body;
  auto work = [st]() {
    const int before = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int64_t i; (i = st->next.fetch_add(1)) < st->n;) {
      if (int f = (*st->body)(i)) st->failed.fetch_or(f);
      if (st->done.fetch_add(1) + 1 == st->n) {
        std::lock_guard<std::mutex> lock(st->m);
        st->cv.notify_all();
      }
    }
    omp_set_num_threads(before);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(st->m);
  st->cv.wait(lock, [&] { return st->done.load() == st->n; });
  return st->failed.load();
}

ffi::Error Status(int failed, const char* name) {
  if (failed == 0) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(name) + ": dnnl_sgemm returned status " +
                              std::to_string(failed));
}

ffi::Error CheckHeads(int64_t H, int64_t G, const char* name) {
  if (G <= 0 || H % G != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": key/value heads G=" +
                                       std::to_string(G) + " must divide H=" +
                                       std::to_string(H));
  return ffi::Error::Success();
}

ffi::Error Nt(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> a, ffi::BufferR4<ffi::F32> b,
              ffi::ResultBufferR4<ffi::F32> c) {
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t B = ad[0], T = ad[1], H = ad[2], D = ad[3], S = bd[1], G = bd[2];
  if (auto e = CheckHeads(H, G, "attn_onednn_nt"); e.failure()) return e;
  const float* A = a.typed_data();
  const float* Bm = b.typed_data();
  float* C = c->typed_data();
  if (D == 0) {
    std::memset(C, 0, sizeof(float) * B * H * T * S);
    return ffi::Error::Success();
  }
  const int64_t R = H / G;
  int failed = ParallelFor(pool, B * H, [&](int64_t bh) {
    const int64_t i = bh / H, h = bh % H;
    return dnnl_sgemm('N', 'T', T, S, D, 1.0f, A + (i * T * H + h) * D, H * D,
                      Bm + (i * S * G + h / R) * D, G * D, 0.0f, C + bh * T * S, S);
  });
  return Status(failed, "attn_onednn_nt");
}

ffi::Error Nn(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> a, ffi::BufferR4<ffi::F32> b,
              ffi::ResultBufferR4<ffi::F32> c) {
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t B = ad[0], H = ad[1], T = ad[2], S = ad[3], G = bd[2], D = bd[3];
  if (auto e = CheckHeads(H, G, "attn_onednn_nn"); e.failure()) return e;
  const float* A = a.typed_data();
  const float* Bm = b.typed_data();
  float* C = c->typed_data();
  if (S == 0) {
    std::memset(C, 0, sizeof(float) * B * T * H * D);
    return ffi::Error::Success();
  }
  const int64_t R = H / G;
  int failed = ParallelFor(pool, B * H, [&](int64_t bh) {
    const int64_t i = bh / H, h = bh % H;
    return dnnl_sgemm('N', 'N', T, D, S, 1.0f, A + bh * T * S, S,
                      Bm + (i * S * G + h / R) * D, G * D, 0.0f, C + (i * T * H + h) * D, H * D);
  });
  return Status(failed, "attn_onednn_nn");
}

ffi::Error Tn(ffi::ThreadPool pool, ffi::BufferR4<ffi::F32> a, ffi::BufferR4<ffi::F32> b, int64_t G,
              ffi::ResultBufferR4<ffi::F32> c) {
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t B = ad[0], H = ad[1], T = ad[2], S = ad[3], D = bd[3];
  if (auto e = CheckHeads(H, G, "attn_onednn_tn"); e.failure()) return e;
  const float* A = a.typed_data();
  const float* Bm = b.typed_data();
  float* C = c->typed_data();
  if (T == 0) {
    std::memset(C, 0, sizeof(float) * B * S * G * D);
    return ffi::Error::Success();
  }
  const int64_t R = H / G;
  // One thread owns each (batch, kv head) output and sums its R query heads in turn.
  int failed = ParallelFor(pool, B * G, [&](int64_t bg) {
    const int64_t i = bg / G, g = bg % G;
    int f = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t h = g * R + r;
      f |= dnnl_sgemm('T', 'N', S, D, T, 1.0f, A + (i * H + h) * T * S, S,
                      Bm + (i * T * H + h) * D, H * D, r == 0 ? 0.0f : 1.0f,
                      C + (i * S * G + g) * D, G * D);
    }
    return f;
  });
  return Status(failed, "attn_onednn_tn");
}

// c[n] = a[n] · op(b[n]) for n < N, a (N,M,K), b (N,K,P) or, transposed, (N,P,K): the blocked
// core's block products (attn.kernel.blocked), one matrix per item.
ffi::Error Bmm(ffi::ThreadPool pool, ffi::BufferR3<ffi::F32> a, ffi::BufferR3<ffi::F32> b,
               bool transb, ffi::ResultBufferR3<ffi::F32> c) {
  auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t N = ad[0], M = ad[1], K = ad[2], P = transb ? bd[1] : bd[2];
  const float* A = a.typed_data();
  const float* Bm = b.typed_data();
  float* C = c->typed_data();
  if (K == 0) {
    std::memset(C, 0, sizeof(float) * N * M * P);
    return ffi::Error::Success();
  }
  int failed = ParallelFor(pool, N, [&](int64_t n) {
    return dnnl_sgemm('N', transb ? 'T' : 'N', M, P, K, 1.0f, A + n * M * K, K, Bm + n * K * P,
                      transb ? K : P, 0.0f, C + n * M * P, P);
  });
  return Status(failed, "attn_onednn_bmm");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(attn_onednn_nt, Nt,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(attn_onednn_nn, Nn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Ret<ffi::BufferR4<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(attn_onednn_tn, Tn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Arg<ffi::BufferR4<ffi::F32>>()
                                  .Attr<int64_t>("G")
                                  .Ret<ffi::BufferR4<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(attn_onednn_bmm, Bmm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR3<ffi::F32>>()
                                  .Arg<ffi::BufferR3<ffi::F32>>()
                                  .Attr<bool>("transb")
                                  .Ret<ffi::BufferR3<ffi::F32>>());
