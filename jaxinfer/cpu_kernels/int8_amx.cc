// int8 x int8 -> int32 products on Intel AMX, for XLA CPU through the XLA FFI:
//   jaxinfer_int8_amx: acc[m, o] = sum_k x[m, k] * w[k, o], exactly the integers of XLA's s8
//                      dot, for any number of rows M, with the weight pre-packed once, at load
//                      time, into AMX's tile layout (``pack`` in __init__.py).
//
// Why: XLA CPU runs the s8 dot through YNNPACK, whose AMX kernel is fast but which repacks the
// whole weight into the VNNI layout on every call. A perf profile of the 64-row w8a8 decode
// step put ynn::interleave4_x8 (the repack) at 15% of all samples against 8% for the AMX dot
// itself. Packed once, the weight streams straight into the tiles.
//
// The packed weight: [O / 16, I / 64, 16, 16, 4] int8, element (nb, kb, r, n, j) =
// w[64 kb + 4 r + j, 16 nb + n]. Block (nb, kb) is one 1 KB B tile of TDPBSSD (16 rows of
// four consecutive k for 16 columns), and a column block's tiles lie one after another, so a
// call streams the weight in order. The activations are the A tiles as they are: 16 rows of
// 64 consecutive k.
//
// Blocking: two column blocks (32 outputs) by two row blocks (32 rows) at a time: 4 C tiles,
// 2 A tiles, 2 B tiles, all 8 of AMX's tile registers; each loaded tile serves two products.
// Rows past the last multiple of 32 run through a zero-padded copy. Column blocks are split
// between the calling thread and XLA's intra-op pool (gemv_split.h).
//
// AMX's tile data is a state the kernel must ask Linux for (arch_prctl ARCH_REQ_XCOMP_PERM,
// once per process): ``jaxinfer_amx_ready`` asks and says whether it was granted, and Python
// calls it before using this kernel.

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <immintrin.h>

#include "gemv_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxinfer_native::Job;
using jaxinfer_native::run;
using jaxinfer_native::split_run;

namespace {

constexpr int64_t kTileK = 64;   // bytes of k per tile row
constexpr int64_t kTileN = 16;   // columns per B tile
constexpr int64_t kTileB = 1024; // bytes per B tile

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (row block i, column block j) at 2 i + j; 4, 5: A row blocks; 6, 7: B.
__attribute__((target("amx-tile,amx-int8"))) void configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C tiles of rows [m, m + 16 * (two ? 2 : 1)) and column blocks nb (and nb + 1 where pair)
// from x [.., I] (row stride I) and the packed weight, stored into c (row stride ldc, int32).
template <bool kTwoRows, bool kPair>
__attribute__((target("amx-tile,amx-int8"))) inline void tile_block(const int8_t* x, int64_t I, const int8_t* b0,
                                                                    int32_t* c, int64_t ldc) {
  const int64_t KB = I / kTileK;
  const int8_t* b1 = b0 + KB * kTileB;
  _tile_zero(0);
  if (kPair) _tile_zero(1);
  if (kTwoRows) _tile_zero(2);
  if (kTwoRows && kPair) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, x + kb * kTileK, I);
    if (kTwoRows) _tile_loadd(5, x + 16 * I + kb * kTileK, I);
    _tile_loadd(6, b0 + kb * kTileB, 64);
    if (kPair) _tile_loadd(7, b1 + kb * kTileB, 64);
    _tile_dpbssd(0, 4, 6);
    if (kPair) _tile_dpbssd(1, 4, 7);
    if (kTwoRows) _tile_dpbssd(2, 5, 6);
    if (kTwoRows && kPair) _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, c, ldc * 4);
  if (kPair) _tile_stored(1, c + 16, ldc * 4);
  if (kTwoRows) _tile_stored(2, c + 16 * ldc, ldc * 4);
  if (kTwoRows && kPair) _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

template <bool kTwoRows>
__attribute__((target("amx-tile,amx-int8"))) inline void tile_cols(const int8_t* x, int64_t I, const int8_t* b0, int32_t* c, int64_t ldc, bool pair) {
  if (pair) {
    tile_block<kTwoRows, true>(x, I, b0, c, ldc);
  } else {
    tile_block<kTwoRows, false>(x, I, b0, c, ldc);
  }
}

// Columns [c0, c1) (multiples of 16) of out [M, O].
__attribute__((target("amx-tile,amx-int8"))) void run_amx(const Job& j) {
  const auto* x = static_cast<const int8_t*>(j.x);
  const auto* w = static_cast<const int8_t*>(j.w);
  auto* out = static_cast<int32_t*>(j.out);
  const int64_t M = j.M, I = j.I, O = j.O, KB = I / kTileK;
  const int64_t full = M / 32 * 32, tail = M - full;
  // the rows past the last 32: a zero-padded copy, and their C tiles' scratch
  std::vector<int8_t> xpad(tail ? 32 * I : 0, 0);
  std::vector<int32_t> cpad(tail ? 32 * 32 : 0);
  if (tail) std::memcpy(xpad.data(), x + full * I, tail * I);
  configure();
  for (int64_t o = j.c0; o < j.c1; o += 32) {
    const bool pair = o + 16 < j.c1;
    const int8_t* b0 = w + (o / kTileN) * KB * kTileB;
    for (int64_t m = 0; m < full; m += 32) tile_cols<true>(x + m * I, I, b0, out + m * O + o, O, pair);
    if (tail) {
      if (tail > 16) {
        tile_cols<true>(xpad.data(), I, b0, cpad.data(), 32, pair);
      } else {
        tile_cols<false>(xpad.data(), I, b0, cpad.data(), 32, pair);
      }
      for (int64_t r = 0; r < tail; ++r)
        std::memcpy(out + (full + r) * O + o, cpad.data() + r * 32, (pair ? 32 : 16) * sizeof(int32_t));
    }
  }
  _tile_release();
}

ffi::Error Int8Amx(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> out,
                   int64_t threads, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || wd.size() != 5 || od[0] != xd[0])
    return ffi::Error::InvalidArgument("int8_amx: x must be [M, I], w [O/16, I/64, 16, 16, 4], out [M, O]");
  const int64_t M = xd[0], I = xd[1], O = od[1];
  if (I % kTileK || O % kTileN || wd[0] != O / kTileN || wd[1] != I / kTileK || wd[2] != 16 || wd[3] != 16 ||
      wd[4] != 4)
    return ffi::Error::InvalidArgument("int8_amx: the packed weight does not match x [M, I] and out [M, O]");
  if (M == 0) return ffi::Error::Success();
  const Job all{run_amx, x.typed_data(), w.typed_data(), out->typed_data(), M, I, O, 0, O};
  split_run(all, 32, threads, pool);  // O past a multiple of 32 (16 columns) runs with the last range
  return ffi::Error::Success();
}

}  // namespace

// 1 where this process may use AMX tiles (asked once), 0 where Linux refused.
extern "C" int jaxinfer_amx_ready() {
  static const int ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 1 : 0;
  }();
  return ok;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_amx, Int8Amx,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>());
